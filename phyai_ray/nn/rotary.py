"""Rotary position embeddings, every variant the model families use, in one place (vLLM's `get_rope`):

    Rope(theta, kind, ...)            a checkpoint's rotary config: `inverse_frequencies(head_dim)` with the
                                      scaling its kind says (default, linear, llama3); `rope_from_config`
                                      reads it from a transformers config.json
    rope_cos_sin(positions, inv_freq) the half-split tables [N, 1, d] (Llama / Qwen / Mistral / Gemma)
    rotate_half(x, cos, sin)          x * cos + rotate_half(x) * sin, the half-split layout
    gemma_rope(x, positions, base)    pi0 / pi0.5's Gemma (transformers' form), tables per call, float32
    float32_rope(x, positions, base)  SmolVLA's (LeRobot's `apply_rope`): computed in float32, cast back
    rotate_pairs(x, cos, sin)         Wan's 3-D rotary on interleaved channel pairs (2i, 2i+1); diffusers'
                                      `WanRotaryPosEmbed` gives the tables

A worked example, d = 4, theta = 10000: inverse frequencies [1, 0.01]; at position 3 the angles are
[3, 0.03, 3, 0.03] (half-split: each frequency twice), and channel i pairs with channel i + d/2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3")


class RopeConfigError(ValueError):
    """A rotary config this library cannot apply; the message names the field and what is supported."""


@dataclass(frozen=True)
class Rope:
    """Rotary embedding: base `theta`, `kind` in ROPE_TYPES and that kind's scaling parameters."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def inverse_frequencies(self, head_dim: int) -> torch.Tensor:
        """[head_dim / 2] float32: theta^(-2i/d), scaled as the kind says (llama3: by wavelength band)."""
        inv = 1.0 / self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            wavelen = 2 * math.pi / inv
            old = self.original_max_position
            low, high = old / self.low_freq_factor, old / self.high_freq_factor
            scaled = torch.where(wavelen > low, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            medium = (wavelen >= high) & (wavelen <= low)
            return torch.where(medium, (1 - smooth) * scaled / self.factor + smooth * scaled, scaled)
        return inv


def rope_from_config(raw: dict[str, Any], where: Any = "config.json") -> Rope:
    """A transformers config's rotary settings: transformers 5 writes `rope_parameters` (with rope_theta);
    earlier checkpoints `rope_theta` + `rope_scaling`. RopeConfigError names an unsupported kind."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise RopeConfigError(f"{where}: rope type {kind!r} (rope_parameters / rope_scaling) is not supported; "
                              f"supported: {list(ROPE_TYPES)}")
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    fields = {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
              "original_max_position": "original_max_position_embeddings"}
    return Rope(theta=theta, kind=kind, **{k: type(getattr(Rope, k))(params[v]) for k, v in fields.items()
                                           if v in params})


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-split tables for tokens at `positions` [N]: cos, sin [N, 1, d] in `dtype` (angles in float32)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout: x [..., heads, d], cos / sin broadcastable to it."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


def gemma_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Gemma's rotary embedding (transformers' rotate_half form) of x [B, L, H, D] at positions [B, L]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64, device=x.device).float() / d))
    freqs = positions[..., None].float() * inv_freq[None, None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return rotate_half(x, emb.cos()[:, :, None, :], emb.sin()[:, :, None, :])


def float32_rope(x: torch.Tensor, positions: torch.Tensor, max_wavelength: float = 10_000) -> torch.Tensor:
    """Rotary positions [B, L] applied to x [B, L, H, D] in float32, cast back (LeRobot's `apply_rope`):
    the angle of channel pair i is position / max_wavelength^(2i/D)."""
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


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on [b, s, h, d]: channel pairs (2i, 2i+1) turned by the pair's angle."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)
