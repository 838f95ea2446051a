"""The sharded layers of one rank: attention, dense MLP, mixture-of-experts MLP.

Every rank of a pipeline/CFG partition holds the full residual stream x [B, S, dim]. Each layer
takes this rank's slice of the work, computes it, and gathers the result back to the full
stream, so the three domains can split the same ranks in different ways:

    attention   batch split over attention_dp, sequence over attention_cp, heads over attention_tp
    dense MLP   batch split over dense_dp, hidden units over dense_tp
    MoE MLP     batch split over moe_dp, experts over moe_ep, each expert's hidden units over moe_tp

A dp axis only splits the batch when the user set that domain explicitly; an inferred dp
replicates the work (every rank computes the same thing, nothing to gather).
Tensor parallel is the usual column-parallel up projection / row-parallel down projection:
with tp=2 and hidden=256, rank 0 keeps rows 0..127 of W1 and columns 0..127 of W2, computes a
partial output, and `all_reduce` over the tp group sums the two halves. The bias of a
row-parallel projection is added once, after the reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from phyai_ray.collectives import P
from phyai_ray.nn.attention import attention
from phyai_ray.nn.norm import layer_norm
from phyai_ray.nn.shape import TransformerShape
from phyai_ray.nn.weights import Weights, shard


@dataclass(frozen=True)
class Split:
    """This rank's position on one axis: chunk `index` of `count`, exchanged over `group`."""

    group: str
    index: int = 0
    count: int = 1

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x if self.count == 1 else x.chunk(self.count, dim)[self.index]

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x if self.count == 1 else P.all_gather(x, self.group, dim=dim)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.count == 1 else P.all_reduce(x, self.group)


def split(ctx: Any, group: str, explicit: bool = True) -> Split:
    """The Split of `group` for this rank; `explicit=False` (inferred dp) means no split."""
    if not explicit:
        return Split(group)
    return Split(group, ctx.group_rank(group), ctx.group_size(group))


def batch_split(ctx: Any, domain: str) -> Split:
    return split(ctx, f"{domain}_dp", domain in ctx.parallel.explicit_domains)


def norm(x: torch.Tensor) -> torch.Tensor:
    """LayerNorm over the last dimension, without weight or bias (the reference models' pre-norm)."""
    return layer_norm(x)


class Attention:
    """Pre-norm multi-head self-attention (bidirectional, as in a DiT) with a residual."""

    def __init__(self, cfg: TransformerShape, w: Weights, ctx: Any, to: dict) -> None:
        self.tp, self.cp, self.dp = split(ctx, "attention_tp"), split(ctx, "attention_cp"), batch_split(ctx, "attention")
        self.head_dim, self.local_heads = cfg.head_dim, cfg.heads // self.tp.count
        rows = (0, self.tp.index, self.tp.count)  # q/k/v rows = this rank's heads
        self.wq, self.wk, self.wv = (shard(w[n], *rows).to(**to) for n in ("wq", "wk", "wv"))
        self.wo = shard(w["wo"], 1, self.tp.index, self.tp.count).to(**to)
        self.bo = w["bo"].to(**to)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = norm(self.cp.take(self.dp.take(x, 0), 1))  # [b, s, dim]: my batch rows, my sequence chunk
        q, k, v = (self._heads(h @ w.T) for w in (self.wq, self.wk, self.wv))
        k, v = self.cp.gather(k, 2), self.cp.gather(v, 2)  # every query sees the whole sequence
        a = attention(q, k, v).transpose(1, 2).flatten(2)  # [b, s, local_heads * head_dim]
        out = self.tp.reduce(a @ self.wo.T) + self.bo
        return x + self.dp.gather(self.cp.gather(out, 1), 0)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)  # [b, heads, s, head_dim]


class DenseMLP:
    """Pre-norm GELU MLP; hidden units split over dense_tp."""

    def __init__(self, cfg: TransformerShape, w: Weights, ctx: Any, to: dict) -> None:
        self.tp, self.dp = split(ctx, "dense_tp"), batch_split(ctx, "dense")
        self.w1 = shard(w["w1"], 0, self.tp.index, self.tp.count).to(**to)
        self.b1 = shard(w["b1"], 0, self.tp.index, self.tp.count).to(**to)
        self.w2 = shard(w["w2"], 1, self.tp.index, self.tp.count).to(**to)
        self.b2 = w["b2"].to(**to)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(norm(self.dp.take(x, 0)) @ self.w1.T + self.b1)
        out = self.tp.reduce(h @ self.w2.T) + self.b2
        return x + self.dp.gather(out, 0)


class MoeMLP:
    """Pre-norm top-k mixture of experts; experts split over moe_ep, expert hidden over moe_tp.

    Every EP rank sees all tokens of its moe_dp shard (the stream is replicated), so dispatch is
    gather + mask + all_reduce: the router runs everywhere, rank r evaluates only its experts
    [r*E/ep, (r+1)*E/ep) on the tokens routed to them, and the sum over moe_tp and moe_ep adds
    the missing hidden units and experts. Gates are the top-k softmax probabilities, renormalised.
    """

    def __init__(self, cfg: TransformerShape, w: Weights, ctx: Any, to: dict) -> None:
        self.tp, self.ep, self.dp = split(ctx, "moe_tp"), split(ctx, "moe_ep"), batch_split(ctx, "moe")
        self.top_k, per_rank = cfg.top_k, cfg.experts // self.ep.count
        self.first = self.ep.index * per_rank
        mine = slice(self.first, self.first + per_rank)
        self.router = w["router"].to(**to)
        self.w1 = shard(w["w1"][mine], 1, self.tp.index, self.tp.count).to(**to)
        self.b1 = shard(w["b1"][mine], 1, self.tp.index, self.tp.count).to(**to)
        self.w2 = shard(w["w2"][mine], 2, self.tp.index, self.tp.count).to(**to)
        self.b2 = w["b2"][mine].to(**to) * (self.tp.index == 0)  # added once per expert, by tp rank 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xs = self.dp.take(x, 0)
        h = norm(xs).flatten(0, 1)  # [tokens, dim]
        gates, chosen = (h @ self.router.T).softmax(-1).topk(self.top_k, dim=-1)
        gates = gates / gates.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for local, expert in enumerate(range(self.first, self.first + self.w1.shape[0])):
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            if token.numel():
                y = F.gelu(h[token] @ self.w1[local].T + self.b1[local]) @ self.w2[local].T + self.b2[local]
                out.index_add_(0, token, y * gates[token, slot, None])
        out = self.ep.reduce(self.tp.reduce(out)).view_as(xs)
        return x + self.dp.gather(out, 0)


def mlp_blocks(w: dict[str, torch.Tensor], blocks: int, ctx: Any, to: dict) -> list[DenseMLP]:
    """The policy's residual MLP blocks ("{b}.w1" ... "{b}.b2"), each rank keeping its dense_tp shard."""
    return [DenseMLP(None, {k: w[f"{b}.{k}"] for k in ("w1", "b1", "w2", "b2")}, ctx, to) for b in range(blocks)]
