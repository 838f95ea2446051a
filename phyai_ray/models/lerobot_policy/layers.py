"""Pieces the LeRobot policies share: attention wired to nn's entry, masks, the time embedding, stacking.

They follow LeRobot 0.4.4's arithmetic step for step (its `eager_attention_forward`, `make_att_2d_masks`,
`create_sinusoidal_pos_embedding`; the rotary embeddings and norms are nn's `float32_rope`, `gemma_rope`
and `GemmaRMSNorm`), so that a frame here and in LeRobot gives the same numbers to float rounding.

Stacking frames: every robot's prefix (images, language, state) has its own length L_i. A batch
(slots.py's pool, read by each robot's slot) pads them on the right to L_max; `prefix_pad` [B, L_max]
is True on real positions, and keys and values at padded positions are zero and masked out, so a
frame's attention ignores them exactly.
The prefix pass of the frames admitted together stacks their embeddings the same way (`stack_right`,
`pad_mask`) and their cameras by image size (`by_shape`).
"""

from __future__ import annotations

import math
from typing import Any, Generator

import torch

from phyai_ray.nn.attention import attention


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """nn's attention entry on this family's layout: q [B, S, H, D], k / v [B, T, KV, D], mask [B, S, T]
    (True: attend) -> [B, S, H * D]. The "eager" backend is LeRobot's arithmetic (float32 scores, masked
    with float32's min, float32 softmax); its grouped queries read their shared key head without copies."""
    out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask.unsqueeze(1), backend="eager")
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


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


def run_steps(steps: Generator[int, None, Any]) -> Any:
    """Run a generator of layer steps (`prefix_steps`) to its end; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def pad_mask(lengths: list[int], length: int, device: torch.device) -> torch.Tensor:
    """[B, length] True on each row's first L_i positions."""
    return torch.arange(length, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]

