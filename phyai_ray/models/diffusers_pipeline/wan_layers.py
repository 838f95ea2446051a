"""The pieces a parallel Wan transformer is built from: token ranges, the Ulysses exchange, and
tensor-parallel linears and norms that keep diffusers' parameter names.

Sequence parallel (Ulysses) over `attention_cp`, cp ranks: the S latent tokens are cut into cp
contiguous ranges, the first S % cp one token longer (`token_ranges(10, 4)` ->
(0, 3) (3, 6) (6, 8) (8, 10)). Everything but self-attention is per token, so each rank runs it
on its own range. Self-attention needs every token: after q/k/v (and rotary, on the rank's own
tokens) one all-to-all trades "my tokens, all heads" for "all tokens, my heads":

    rank r holds [b, s_r, h, d]  --all_to_all-->  [b, S, h/cp, d]   (heads r*h/cp .. (r+1)*h/cp)
    attention over the whole sequence for h/cp heads, then the inverse all-to-all back to [b, s_r, h, d].

Tensor parallel over `attention_tp` / `dense_tp`, tp ranks: rank g keeps heads g*h/tp .. (g+1)*h/tp,
i.e. rows g*inner/tp .. (g+1)*inner/tp of to_q/to_k/to_v (a column-parallel linear, `nn.Linear`
with the sliced rows) and the same columns of to_out (`RowParallelLinear`: partial product,
all_reduce, bias once). Wan's q/k RMSNorm normalises over ALL heads, so `HeadShardedRMSNorm`
sums the squares of its own heads and all-reduces that sum before dividing. The FFN splits its
hidden units the same way: rows of `net.0.proj`, columns of `net.2`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from phyai_ray.collectives import P


def token_ranges(tokens: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of `tokens` over `parts` ranks, the first `tokens % parts`
    ranges one token longer: `token_ranges(10, 4)` -> [(0, 3), (3, 6), (6, 8), (8, 10)]."""
    if parts < 1 or tokens < parts:
        raise ValueError(f"cannot split {tokens} latent tokens over {parts} sequence-parallel ranks: every "
                         "rank needs at least one token; use a larger video (frames, height, width) or a "
                         "smaller attention.cp_size")
    base, extra = divmod(tokens, parts)
    sizes = [base + (i < extra) for i in range(parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def shard_rows(t: torch.Tensor, dim: int, index: int, count: int) -> torch.Tensor:
    """Chunk `index` of `count` equal chunks of `t` along `dim`, as its own storage."""
    if t.shape[dim] % count:
        raise ValueError(f"cannot split a tensor of shape {tuple(t.shape)} into {count} equal parts "
                         f"along dim {dim}")
    return t.chunk(count, dim)[index].clone()


# -- Ulysses: the buffers each side of an all-to-all over `attention_cp` --------------------------

def heads_send_buffer(x: torch.Tensor, cp: int) -> torch.Tensor:
    """[b, s, h, d] -> [cp * s, b, h/cp, d]; rows j*s .. (j+1)*s are head group j (sent to rank j)."""
    b, s, h, d = x.shape
    return x.reshape(b, s, cp, h // cp, d).permute(2, 1, 0, 3, 4).reshape(cp * s, b, h // cp, d)


def heads_received(buffer: torch.Tensor) -> torch.Tensor:
    """[S, b, h/cp, d] (every rank's tokens, in rank order) -> [b, S, h/cp, d]."""
    return buffer.permute(1, 0, 2, 3)


def tokens_send_buffer(x: torch.Tensor) -> torch.Tensor:
    """[b, S, h/cp, d] -> [S, b, h/cp, d]; rank j's token range goes back to rank j."""
    return x.permute(1, 0, 2, 3)


def tokens_received(buffer: torch.Tensor, cp: int) -> torch.Tensor:
    """[cp * s, b, h/cp, d] (head group j from rank j) -> [b, s, h, d]."""
    rows, b, hl, d = buffer.shape
    s = rows // cp
    return buffer.reshape(cp, s, b, hl, d).permute(2, 1, 0, 3, 4).reshape(b, s, cp * hl, d)


def to_all_tokens(x: torch.Tensor, group: str, sizes: Sequence[int]) -> torch.Tensor:
    """[b, s_r, h, d] on every rank -> [b, S, h/cp, d]: all tokens, this rank's head group."""
    cp = len(sizes)
    out = P.all_to_all(heads_send_buffer(x, cp), group, output_split_sizes=sizes,
                       input_split_sizes=[x.shape[1]] * cp)
    return heads_received(out)


def to_own_tokens(x: torch.Tensor, group: str, sizes: Sequence[int], index: int) -> torch.Tensor:
    """The inverse of `to_all_tokens`: [b, S, h/cp, d] -> [b, s_r, h, d]."""
    cp = len(sizes)
    out = P.all_to_all(tokens_send_buffer(x), group, output_split_sizes=[sizes[index]] * cp,
                       input_split_sizes=sizes)
    return tokens_received(out, cp)


def gather_tokens(x: torch.Tensor, group: str, sizes: Sequence[int], dim: int = 1) -> torch.Tensor:
    """Every rank's token range of `x` (`sizes[r]` tokens on rank r along `dim`), joined in order.

    all_gather needs equal shapes, so each range is padded to the longest and trimmed after."""
    longest = max(sizes)
    if x.shape[dim] < longest:
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim)
    parts = P.all_gather(x, group, dim=dim).split(longest, dim)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)


# -- Tensor parallel modules ----------------------------------------------------------------------

def column_linear(linear: nn.Linear, index: int, count: int) -> nn.Linear:
    """Rows `index` of `count` of a linear's weight and bias: this rank's output units."""
    return _linear(nn.Linear, shard_rows(linear.weight.data, 0, index, count),
                   None if linear.bias is None else shard_rows(linear.bias.data, 0, index, count),
                   linear.weight.requires_grad)


class RowParallelLinear(nn.Linear):
    """Columns of the input units; the partial products are summed over `group`, the bias added once.

    An `nn.Linear` (same `weight` / `bias` names), so weights load and update by diffusers' names."""

    group: str = "attention_tp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = P.all_reduce(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


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


class HeadShardedRMSNorm(nn.Module):
    """RMSNorm over ALL heads of a tensor whose heads are split over `group`.

    Rank g holds the channels of its heads and their slice of `weight`. The mean square is the sum
    of every rank's squares divided by the full width, so the sum is all-reduced first:
    y = x * rsqrt(sum_all(x^2) / full_width + eps) * weight."""

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
