"""Norms every model family builds from, side by side as vLLM keeps `RMSNorm` and `GemmaRMSNorm`:

    rms_norm(x, w, eps)              transformers' RMSNorm (Llama, Qwen2/3, SmolVLM): normalised in float32,
                                     cast back to x's dtype, then scaled by w
    GemmaRMSNorm(dim, cond_dim)      pi0 / pi0.5's: float32 result, 1 + w, or pi0.5's adaptive form
                                     (scale, shift, gate from a condition vector)
    HeadShardedRMSNorm               RMSNorm over ALL heads of a tensor whose heads are split over a
                                     tensor-parallel group (Wan's q/k norm under TP): the sums of squares
                                     are all-reduced before dividing
    layer_norm(x, w, b, eps) / LayerNorm(w, b, eps)   LayerNorm with a checkpoint's weight and bias

Each keeps the arithmetic order of the reference it serves (transformers, LeRobot, diffusers), so a
parity test sees the same rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phyai_ray.collectives import P
from phyai_ray.nn.linear import shard_rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, cast back, then scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype) if weight is None else weight * h.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension (no affine part when weight and bias are None)."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


class LayerNorm(nn.Module):
    """LayerNorm over the hidden size with a checkpoint's weight, bias and eps (frozen parameters)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm as pi0 computes it (float32 result, weight as 1 + w) or, with `cond_dim`,
    pi0.5's adaptive RMSNorm: `dense(cond)` gives scale, shift and a gate for the residual.

    `forward(x, cond)` -> (normed, gate); the gate is None without a condition."""

    def __init__(self, dim: int, cond_dim: int | None = None, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        if cond_dim is None:
            self.weight = nn.Parameter(torch.zeros(dim))
        else:
            self.dense = nn.Linear(cond_dim, dim * 3)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        normed = x * torch.rsqrt(torch.mean(torch.square(x.float()), dim=-1, keepdim=True) + self.eps)
        if cond is None:
            return normed * (1.0 + self.weight.float()), None
        scale, shift, gate = torch.chunk(self.dense(cond)[:, None, :], 3, dim=-1)
        return normed * (1 + scale) + shift, gate


class HeadShardedRMSNorm(nn.Module):
    """RMSNorm over ALL heads of a tensor whose heads are split over `group`.

    Rank g holds the channels of its heads and their slice of `weight`. The mean square is the sum
    of every rank's squares divided by the full width, so the sum is all-reduced first:
    y = x * rsqrt(sum_all(x^2) / full_width + eps) * weight. Two norms of one block (q and k) can
    share one all_reduce: `squares` of both, concatenated, reduced, then `scale` each."""

    def __init__(self, norm: nn.RMSNorm, index: int, count: int, group: str) -> None:
        super().__init__()
        (self.full_width,) = norm.normalized_shape
        self.eps, self.group = norm.eps, group
        weight = None if norm.weight is None else shard_rows(norm.weight.data, 0, index, count)
        grad = norm.weight is not None and norm.weight.requires_grad
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=grad)

    def squares(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's sum of squares per token, [..., 1], in float32."""
        return x.float().pow(2).sum(-1, keepdim=True)

    def scale(self, x: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """Normalise `x` given the all-reduced sum of squares."""
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        y = (x.float() * torch.rsqrt(squares / self.full_width + eps)).type_as(x)
        return y if self.weight is None else y * self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x, P.all_reduce(self.squares(x), self.group))


def sharded_qk_norm(norm_q: nn.Module, norm_k: nn.Module, q: torch.Tensor, k: torch.Tensor,
                    group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q / k norms of one attention block; when both are head-sharded, their sums of squares travel
    in ONE all_reduce over `group` instead of two."""
    if not (isinstance(norm_q, HeadShardedRMSNorm) and isinstance(norm_k, HeadShardedRMSNorm)):
        return norm_q(q), norm_k(k)
    squares = P.all_reduce(torch.cat([norm_q.squares(q), norm_k.squares(k)], -1), group)
    return norm_q.scale(q, squares[..., :1]), norm_k.scale(k, squares[..., 1:])
