"""One iteration's new tokens over a paged KV cache, unpadded, and attention through the block tables.

    batch = RaggedBatch.build(chunks, block_size=16, device=cpu)
    ...per layer: q [N, heads, d], k / v [N, kv_heads, d] of the N new tokens...
    batch.write(keys, values, k, v)                 # into their blocks, before attending
    out = batch.attend(q, keys, values)             # [N, heads, d]
    logits at batch.last                            # the last token of every chunk that samples

Decode rows (a chunk of one token) come first and attend together: each gathers its keys
through its block table, [D, kv, W * block_size, d] with W the longest table, and a length mask
hides the columns past its own length (memory D x T, no query dimension). Every longer chunk
(a prompt, part of one, or a rebuild) attends alone: its n queries see its cached columns and
the causal part of its own, an [n, cached + n] mask. Nothing is B x S x T.

Grouped-query attention as in the slot path: the G = heads / kv_heads queries that read one
key/value head are stacked, so the blocks hold kv heads only. Attention is
`torch.nn.functional.scaled_dot_product_attention` with a boolean mask (True: may attend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from phyai_ray.llm.paged import Chunk
from phyai_ray.llm.slots import _tensor


@dataclass(frozen=True)
class Prefill:
    """A chunk of more than one token: its place in the batch, its blocks, and its causal mask."""

    start: int  # index of its first token in the batch
    n: int
    blocks: torch.Tensor  # [nb]: the blocks of columns 0 .. cached + n - 1
    length: int  # cached + n
    mask: torch.Tensor  # [n, length] bool


@dataclass(frozen=True)
class RaggedBatch:
    """The N new tokens of one iteration, decode rows first (see the module docstring)."""

    tokens: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]: cache column = position in its sequence
    write_blocks: torch.Tensor  # [N]
    write_rows: torch.Tensor  # [N]: row inside the block
    last: torch.Tensor  # [R]: index of the last token of each chunk that samples, in the order of the chunks
    decodes: int  # D: tokens 0 .. D-1 are decode rows
    table: torch.Tensor | None  # [D, W] block ids (0 past a table's end: masked)
    visible: torch.Tensor | None  # [D, 1, 1, W * block_size] bool
    prefills: tuple[Prefill, ...]

    @classmethod
    def build(cls, chunks: list[Chunk], block_size: int, device: Any) -> "RaggedBatch":
        """The batch of `chunks`: one-token chunks first; `last` follows the order of `chunks`."""
        ordered = [c for c in chunks if c.n == 1] + [c for c in chunks if c.n > 1]
        tokens, positions, ends = [], [], {}
        for c in ordered:
            tokens += c.seq.pending[:c.n]
            positions += range(c.seq.cached, c.seq.cached + c.n)
            ends[id(c)] = len(tokens) - 1
        last = [ends[id(c)] for c in chunks if c.samples]
        blocks = [c.seq.blocks[p // block_size] for c in ordered for p in range(c.seq.cached, c.seq.cached + c.n)]
        parts = [tokens, positions, blocks, [p % block_size for p in positions], last]
        packed = _tensor("q", [v for part in parts for v in part]).to(device).split([len(p) for p in parts])
        decodes = sum(1 for c in chunks if c.n == 1)
        table, visible = _decode_table(ordered[:decodes], block_size, device)
        prefills, start = [], decodes
        for c in ordered[decodes:]:
            prefills.append(_prefill(c, start, block_size, device))
            start += c.n
        return cls(*packed, decodes, table, visible, tuple(prefills))

    def write(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' k / v [N, kv, d] in their blocks' rows."""
        keys[self.write_blocks, :, self.write_rows] = k
        values[self.write_blocks, :, self.write_rows] = v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention of the new queries q [N, heads, d] over their sequences' cached keys: [N, heads, d]."""
        n, heads, d = q.shape
        kv = keys.shape[1]
        group = heads // kv
        out = q.new_empty(n, heads, d)
        if self.decodes:
            dq = q[:self.decodes].view(self.decodes, kv, group, d)
            o = F.scaled_dot_product_attention(dq, _gather(keys, self.table), _gather(values, self.table),
                                               attn_mask=self.visible)
            out[:self.decodes] = o.reshape(self.decodes, heads, d)
        for p in self.prefills:
            pq = q[p.start:p.start + p.n].view(p.n, kv, group, d).permute(1, 2, 0, 3).reshape(1, kv, group * p.n, d)
            k = _gather(keys, p.blocks[None])[:, :, :p.length]
            v = _gather(values, p.blocks[None])[:, :, :p.length]
            o = F.scaled_dot_product_attention(pq, k, v, attn_mask=p.mask.repeat(group, 1))
            out[p.start:p.start + p.n] = o.view(kv, group, p.n, d).permute(2, 0, 1, 3).reshape(p.n, heads, d)
        return out


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache [blocks, kv, bs, d] through tables [R, W] -> [R, kv, W * bs, d]: each row's columns in order."""
    rows, width = table.shape
    _, kv, bs, d = cache.shape
    return cache[table].permute(0, 2, 1, 3, 4).reshape(rows, kv, width * bs, d)


def _decode_table(chunks: list[Chunk], block_size: int, device: Any) -> tuple[Any, Any]:
    if not chunks:
        return None, None
    width = max(len(c.seq.blocks) for c in chunks)
    table = _tensor("q", [b for c in chunks for b in c.seq.blocks + [0] * (width - len(c.seq.blocks))])
    lengths = _tensor("q", [c.seq.cached + 1 for c in chunks])
    visible = torch.arange(width * block_size)[None, :] < lengths[:, None]
    return table.view(len(chunks), width).to(device), visible.view(len(chunks), 1, 1, -1).to(device)


def _prefill(c: Chunk, start: int, block_size: int, device: Any) -> Prefill:
    length = c.seq.cached + c.n
    used = c.seq.blocks[:-(-length // block_size)]
    sees = torch.arange(c.seq.cached, length)[:, None]  # query i's position: it sees keys 0 .. its position
    mask = torch.arange(length)[None, :] <= sees
    return Prefill(start, c.n, torch.tensor(used, device=device), length, mask.to(device))
