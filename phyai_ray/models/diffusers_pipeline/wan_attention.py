"""Wan's self-attention on one rank of a sequence- and/or tensor-parallel split, wired from `phyai_ray.nn`.

`ParallelSelfAttention` replaces diffusers' `WanAttnProcessor` on every block's `attn1`; it computes
what that processor computes for self-attention, in the same order, from the layers room:

    q, k, v = to_q/k/v(x)            diffusers' projections: this rank's tokens; this rank's heads under TP
    q, k = norm_q(q), norm_k(k)      nn.norm.sharded_qk_norm: RMSNorm over all heads; under TP one
                                     all_reduce of both sums of squares
    rotary on q, k                   nn.rotary.rotate_pairs with the angle table already cut to this
                                     rank's tokens (wan_parallel's hook)
    attention over all tokens        nn.sequence.ulysses_attention, backend "diffusers" (diffusers'
                                     dispatcher, so its `attention_backend(...)` choice holds); with
                                     cp > 1 one all-to-all of q|k|v there and one back
    to_out                           row-parallel under TP (nn.linear.RowParallelLinear), bias once

Cross-attention (`attn2`) keeps diffusers' processor: its keys and values come from the whole
text on every rank and its queries are per token, so a token range needs no exchange; under TP
its sharded modules (nn.linear, nn.norm) do the reductions.
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray.nn.norm import sharded_qk_norm
from phyai_ray.nn.rotary import rotate_pairs
from phyai_ray.nn.sequence import SequenceSplit, ulysses_attention


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
        q, k = sharded_qk_norm(attn.norm_q, attn.norm_k, q, k, self.tp_group)
        q, k, v = (t.unflatten(2, (-1, self.head_dim)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = rotate_pairs(q, *rotary_emb), rotate_pairs(k, *rotary_emb)
        out = ulysses_attention(q, k, v, self.split, backend="diffusers").flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))
