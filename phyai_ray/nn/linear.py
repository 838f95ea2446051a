"""Tensor-parallel linears and embeddings, and the index math of a rank's shard (vLLM's
`ColumnParallelLinear` / `RowParallelLinear` / `VocabParallelEmbedding`):

    column parallel   rank g of t keeps output rows [g*O/t, (g+1)*O/t) of W (and of the bias): its
                      output units; nothing to exchange (the next layer consumes the shard)
    row parallel      rank g keeps input columns [g*I/t, (g+1)*I/t) of W: a partial product, summed over
                      the group by ONE all_reduce; the bias is added once, after the sum
    vocab parallel    rank g keeps ceil(V/t) vocabulary rows (the last rank's padded with zeros); a token
                      outside the shard looks up 0 and the group sums the lookups; logits are gathered

    with t=2 and an MLP of hidden 256: rank 0 keeps rows 0..127 of up (column) and columns 0..127 of down
    (row); down's partial outputs are summed by the all_reduce.

Two forms of the same split: functions over plain weight tensors (`row_parallel`, `vocab_embedding`,
`gather_columns`: families that keep a dict of weights by checkpoint name) and `nn.Linear` modules
(`column_linear`, `row_linear` -> `RowParallelLinear`: families that shard a loaded diffusers or
transformers module in place and keep its parameter names). `Cut` says which slice of a full checkpoint
tensor a rank keeps and takes it from a trainer's full tensor (weight updates by name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from phyai_ray.collectives import P


def shard_rows(t: torch.Tensor, dim: int, index: int, count: int) -> torch.Tensor:
    """Chunk `index` of `count` equal chunks of `t` along `dim`, as its own storage."""
    if t.shape[dim] % count:
        raise ValueError(f"cannot split a tensor of shape {tuple(t.shape)} into {count} equal parts "
                         f"along dim {dim}")
    return t.chunk(count, dim)[index].clone()


@dataclass(frozen=True)
class Cut:
    """A rank's slice of one tensor: `dim` None keeps it whole; rows padded to `pad_to` (vocab shards)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    pad_to: int = 0

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a FULL tensor (a trainer's update), as a contiguous copy."""
        if self.dim is None:
            return full.clone()
        part = full.narrow(self.dim, self.start, self.stop - self.start)
        return self.padded(part)

    def padded(self, part: torch.Tensor) -> torch.Tensor:
        if self.pad_to and part.shape[0] < self.pad_to:
            part = torch.cat([part, part.new_zeros(self.pad_to - part.shape[0], *part.shape[1:])])
        return part.contiguous()


# -- the functional form: weights as tensors ---------------------------------------------------------

def row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: str) -> torch.Tensor:
    """x @ weight_shard.T summed over `group`, then the bias once."""
    y = P.all_reduce(F.linear(x, weight), group)
    return y if bias is None else y + bias


def vocab_embedding(tokens: torch.Tensor, weight: torch.Tensor, start: int, group: str) -> torch.Tensor:
    """Embedding lookups from this rank's vocabulary rows [start, start + rows); summed over `group`."""
    rows = weight.shape[0]
    local = tokens - start
    outside = (local < 0) | (local >= rows)
    x = F.embedding(local.masked_fill(outside, 0), weight)
    return P.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0), group)


def gather_columns(x: torch.Tensor, group: str, width: int | None = None) -> torch.Tensor:
    """Every rank's output columns joined in rank order (vocab-parallel logits), cut to `width`."""
    full = P.all_gather(x, group, dim=-1)
    return full if width is None else full[..., :width]


# -- the module form: nn.Linear with the checkpoint's parameter names -----------------------------

class RowParallelLinear(nn.Linear):
    """Columns of the input units; the partial products are summed over `group`, the bias added once.

    An `nn.Linear` (same `weight` / `bias` names), so weights load and update by the checkpoint's names."""

    group: str = "attention_tp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel(x, self.weight, self.bias, self.group)


def column_linear(linear: nn.Linear, index: int, count: int) -> nn.Linear:
    """Rows `index` of `count` of a linear's weight and bias: this rank's output units."""
    return _linear(nn.Linear, shard_rows(linear.weight.data, 0, index, count),
                   None if linear.bias is None else shard_rows(linear.bias.data, 0, index, count),
                   linear.weight.requires_grad)


def row_linear(linear: nn.Linear, index: int, count: int, group: str) -> RowParallelLinear:
    """Columns `index` of `count` of a linear's weight (this rank's input units), full bias."""
    out = _linear(RowParallelLinear, shard_rows(linear.weight.data, 1, index, count),
                  None if linear.bias is None else linear.bias.data.clone(), linear.weight.requires_grad)
    out.group = group
    return out


def _linear(cls: type, weight: torch.Tensor, bias: torch.Tensor | None, grad: bool) -> nn.Linear:
    with torch.device("meta"):
        out = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
    out.weight = nn.Parameter(weight, requires_grad=grad)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=grad)
    return out
