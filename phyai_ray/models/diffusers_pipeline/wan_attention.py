"""Wan's self-attention on one rank of a sequence- and/or tensor-parallel split.

`SequenceSplit` is the rank's token range of the forward in progress (one forward at a time per
transformer). `ParallelSelfAttention` replaces diffusers' `WanAttnProcessor` on every block's
`attn1`; it computes what that processor computes for self-attention, in the same order:

    q, k, v = to_q/k/v(x)            this rank's tokens; this rank's heads under TP
    q, k = norm_q(q), norm_k(k)      RMSNorm over all heads: under TP one all_reduce of both sums
    rotary on q, k                   the rotary table already cut to this rank's tokens
    Ulysses (cp > 1): one all-to-all of q|k|v to [all tokens, heads/cp], attention, the inverse
    to_out                           row-parallel under TP (all_reduce), bias once

Cross-attention (`attn2`) keeps diffusers' processor: its keys and values come from the whole
text on every rank and its queries are per token, so a token range needs no exchange; under TP
its sharded modules (`wan_layers`) do the reductions.
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray.models.diffusers_pipeline.wan_layers import (HeadShardedRMSNorm, gather_tokens, to_all_tokens,
                                                            to_own_tokens, token_ranges)


class SequenceSplit:
    """This rank's share of the latent tokens over `group` (`count` ranks, this one `index`).

    `start(tokens)` is called once per forward, before any block runs; `take` cuts a tensor to the
    rank's range, `gather` joins every rank's ranges back in order."""

    def __init__(self, group: str, index: int, count: int) -> None:
        self.group, self.index, self.count = group, index, count
        self.ranges: list[tuple[int, int]] = [(0, 0)] * count

    def start(self, tokens: int) -> None:
        self.ranges = token_ranges(tokens, self.count)

    @property
    def sizes(self) -> list[int]:
        return [stop - start for start, stop in self.ranges]

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        start, stop = self.ranges[self.index]
        if x.shape[dim] != self.ranges[-1][1]:
            raise ValueError(f"expected {self.ranges[-1][1]} tokens along dim {dim}, got shape {tuple(x.shape)}")
        return x.narrow(dim, start, stop - start)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return gather_tokens(x, self.group, self.sizes, dim)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on [b, s, h, d]: channel pairs (2i, 2i+1) turned by the pair's angle."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class ParallelSelfAttention:
    """Attention processor of a Wan block's `attn1` on one rank (see the module docstring)."""

    def __init__(self, split: SequenceSplit, head_dim: int, tp_group: str = "attention_tp") -> None:
        self.split, self.head_dim, self.tp_group = split, head_dim, tp_group

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: tuple | None = None,
                 **kwargs: Any) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("ParallelSelfAttention serves self-attention without a mask (a Wan block's attn1); "
                             "it was given encoder_hidden_states or attention_mask")
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = self._norm(attn, q, k)
        q, k, v = (t.unflatten(2, (-1, self.head_dim)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        out = self._attend(q, k, v).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))

    def _norm(self, attn: Any, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k RMSNorm over all heads; with heads split, both sums of squares in one all_reduce."""
        nq, nk = attn.norm_q, attn.norm_k
        if not (isinstance(nq, HeadShardedRMSNorm) and isinstance(nk, HeadShardedRMSNorm)):
            return nq(q), nk(k)
        from phyai_ray.collectives import P

        squares = P.all_reduce(torch.cat([nq.squares(q), nk.squares(k)], -1), self.tp_group)
        return nq.scale(q, squares[..., :1]), nk.scale(k, squares[..., 1:])

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention over the whole sequence; [b, s_r, heads, d] in and out."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        split = self.split
        if split.count == 1:
            return dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        qkv = to_all_tokens(torch.cat([q, k, v], -1), split.group, split.sizes)
        q, k, v = qkv.chunk(3, -1)
        out = dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        return to_own_tokens(out.contiguous(), split.group, split.sizes, split.index)
