"""Pieces the LeRobot policies share: rotary positions, eager fp32 attention, masks, the time embedding.

They follow LeRobot 0.4.4's arithmetic step for step (its `apply_rope`, `eager_attention_forward`,
`make_att_2d_masks`, `create_sinusoidal_pos_embedding`), so that a frame here and in LeRobot gives
the same numbers to float rounding.

Stacking frames: every robot's prefix (images, language, state) has its own length L_i. A batch
pads them on the right to L_max; `prefix_pad` [B, L_max] is True on real positions, and keys and
values at padded positions are zero and masked out, so a frame's attention ignores them exactly.
The prefix pass of the frames admitted together stacks their embeddings the same way (`stack_right`,
`pad_mask`) and their cameras by image size (`by_shape`).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def apply_rope(x: torch.Tensor, positions: torch.Tensor, max_wavelength: float = 10_000) -> torch.Tensor:
    """Rotary positions [B, L] applied to x [B, L, H, D] (halves rotated, computed in float32)."""
    d_half = x.shape[-1] // 2
    dtype = x.dtype
    x = x.to(torch.float32)
    freq_exponents = (2.0 / x.shape[-1]) * torch.arange(d_half, dtype=torch.float32, device=x.device)
    timescale = max_wavelength ** freq_exponents
    radians = positions[..., None].to(torch.float32) / timescale[None, None, :].to(torch.float32)
    radians = radians[..., None, :]
    sin, cos = torch.sin(radians), torch.cos(radians)
    x1, x2 = x.split(d_half, dim=-1)
    res = torch.empty_like(x)
    res[..., :d_half] = x1 * cos - x2 * sin
    res[..., d_half:] = x2 * cos + x1 * sin
    return res.to(dtype)


def attention(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
              num_kv_heads: int) -> torch.Tensor:
    """Eager attention in float32: q [B, S, H, D], k / v [B, T, KV, D], mask [B, S, T] (True: attend)
    -> [B, S, H * D]. Key/value heads are repeated for grouped queries; masked scores are float32's min."""
    b, t, _, d = k.shape
    groups = num_heads // num_kv_heads
    k = k[:, :, :, None, :].expand(b, t, num_kv_heads, groups, d).reshape(b, t, num_heads, d)
    v = v[:, :, :, None, :].expand(b, t, num_kv_heads, groups, d).reshape(b, t, num_heads, d)
    q = q.to(torch.float32).transpose(1, 2)
    k = k.to(torch.float32).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5
    scores = torch.where(mask[:, None, :, :], scores, torch.finfo(torch.float32).min)
    probs = nn.functional.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
    return out.reshape(b, -1, num_heads * d)


def att_2d_masks(pad_masks: torch.Tensor, att_masks: torch.Tensor) -> torch.Tensor:
    """big_vision's prefix-LM masks: token i sees token j when cumsum(att)[j] <= cumsum(att)[i] and both are real."""
    cumsum = torch.cumsum(att_masks, dim=1)
    masks = cumsum[:, None, :] <= cumsum[:, :, None]
    return masks & (pad_masks[:, None, :] * pad_masks[:, :, None])


def time_embedding(time: torch.Tensor, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """Sine-cosine embedding [B, dim] of times [B] (float32 times, computed in float64 like LeRobot on CPU/CUDA)."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    scaling = 1.0 / period * 2 * math.pi
    sin_input = scaling[None, :] * time[:, None]
    return torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=1)


def stack_right(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    """[L_i, ...] tensors zero-padded on the right to `length` and stacked: [B, length, ...]."""
    out = tensors[0].new_zeros((len(tensors), length, *tensors[0].shape[1:]))
    for i, t in enumerate(tensors):
        out[i, :t.shape[0]] = t
    return out


def by_shape(images: list[torch.Tensor], fn) -> list[torch.Tensor]:
    """fn over the images [C, H, W] stacked by shape (one call per distinct shape: every frame's cameras of
    one size go through the vision tower together) -> fn's output row of each image, in the given order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, img in enumerate(images):
        groups.setdefault(tuple(img.shape), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(images)
    for members in groups.values():
        for i, row in zip(members, fn(torch.stack([images[i] for i in members]))):
            out[i] = row
    return out


def pad_mask(lengths: list[int], length: int, device: torch.device) -> torch.Tensor:
    """[B, length] True on each row's first L_i positions."""
    return torch.arange(length, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


class StackedPrefixes:
    """The prefix caches of the frames of one expert step, stacked with right padding, per layer and
    on first use; kept while the same frames run, so an unchanged batch re-stacks nothing.

    kind "k" / "v": a layer's keys / values; "ck" / "cv": SmolVLA's projected cross-attention ones.
    """

    def __init__(self, prefixes: list) -> None:
        self.prefixes = prefixes
        self.lengths = [p.length for p in prefixes]
        self.lmax = max(self.lengths)
        self._stacked: dict[tuple[str, int], torch.Tensor] = {}

    def get(self, kind: str, layer: int) -> torch.Tensor:
        key = (kind, layer)
        if key not in self._stacked:
            pick = {"k": lambda p: p.keys[layer], "v": lambda p: p.values[layer],
                    "ck": lambda p: p.cross[layer][0], "cv": lambda p: p.cross[layer][1]}[kind]
            self._stacked[key] = stack_right([pick(p) for p in self.prefixes], self.lmax)
        return self._stacked[key]
