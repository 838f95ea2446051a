"""Sequence parallel (Ulysses) over a context-parallel group, `attention_cp` with cp ranks:

The S tokens are cut into cp contiguous ranges, the first S % cp one token longer (`token_ranges(10, 4)` ->
(0, 3) (3, 6) (6, 8) (8, 10)). Everything but self-attention is per token, so each rank runs it on its own
range. Self-attention needs every token: after q/k/v (and rotary, on the rank's own tokens) one
all-to-all trades "my tokens, all heads" for "all tokens, my heads":

    rank r holds [b, s_r, h, d]  --all_to_all-->  [b, S, h/cp, d]   (heads r*h/cp .. (r+1)*h/cp)
    attention over the whole sequence for h/cp heads, then the inverse all-to-all back to [b, s_r, h, d].

`SequenceSplit` is a rank's token range of the forward in progress; `ulysses_attention` is the
attention entry (`phyai_ray.nn.attention`) run over it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from phyai_ray.collectives import P
from phyai_ray.nn.attention import attention


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


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit,
                      backend: str = "sdpa") -> torch.Tensor:
    """Self-attention of this rank's tokens [b, s_r, heads, d] over the whole sequence of `split`:
    q|k|v to all tokens and this rank's head group in ONE all-to-all, attention, the inverse exchange."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend=backend).transpose(1, 2)

    if split.count == 1:
        return attend(q, k, v)
    q, k, v = to_all_tokens(torch.cat([q, k, v], -1), split.group, split.sizes).chunk(3, -1)
    return to_own_tokens(attend(q, k, v).contiguous(), split.group, split.sizes, split.index)
