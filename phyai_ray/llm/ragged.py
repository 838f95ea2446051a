"""One iteration's new tokens over a paged KV cache, unpadded, and attention through the block tables.

    batch = RaggedBatch.build(chunks, block_size=16, device=cpu)
    ...per layer: q [N, heads, d], k / v [N, kv_heads, d] of the N new tokens...
    batch.write(keys, values, k, v)                 # into their blocks, before attending
    out = batch.attend(q, keys, values)             # [N, heads, d]
    logits at batch.last                            # the last token of every chunk that samples

Decode rows (a chunk of one token) come first and attend together over the pool's blocks
(`paged_decode_attention`): the blocks every row reads are listed once, with the row each belongs to
and which of its columns lie within that row's length; only those blocks are read (one copy, no
padding to the longest row), and a segment softmax per row joins them. Transient memory: the KV
read, plus a few scores per block. While padding to the longest row would copy at most
PADDED_WASTE times the blocks read (rows of similar lengths), or PADDED_WASTE times SHORT_ROW
blocks a row (short rows: 64 rows copy at most 614 blocks, whatever they read), the rows' blocks
are copied padded instead and SDPA attends over the copy (`decode_attention`):
little memory, and faster on a CPU (64 rows of 1..4 blocks: `bench_hf.py`'s throughput run 5-8% faster).

Cascade (decode rows that share cached prefix blocks, e.g. the n samples of one GRPO prompt):
the shared blocks are gathered ONCE for the group and every row's queries attend to them
together; each row's own table starts after them. The two partial softmaxes are merged by
their log-sum-exp (out = w_p * o_prefix + w_s * o_suffix), so a group of n rows reads its
prompt's keys once instead of n times. Rows that share nothing take the plain path. The longer chunks
(a prompt, part of one, or a rebuild) attend in groups of similar sizes, one attention call a group:
chunk p's n queries see its cached columns and the causal part of its own, padded to the group's
longest (`Prefills`; 256 fresh prompts of 8-23 tokens: a few calls a layer instead of 256).

Grouped-query attention: the G = heads / kv_heads queries that read one key/value head are
stacked, so the blocks hold kv heads only. This module prepares the tables, masks and gathers;
the kernels are `phyai_ray.nn.attention`'s `paged_decode_attention`, `paged_attention_lse` with
`cascade_merge`, and `attention` (the attention entry's backends, boolean masks: True may attend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from phyai_ray.llm.paged import Chunk
from phyai_ray.llm.sequence import tensor_of as _tensor
from phyai_ray.nn.attention import (attention, cascade_attention, cascade_merge, decode_attention,
                                    paged_attention_lse, paged_decode_attention)

PADDED_WASTE = 1.2  # decode rows' keys are copied padded to the longest row while that copy is at most this
# many times the blocks they read (SDPA over the copy is faster on a CPU); past it, read over blocks
SHORT_CHUNK = 32  # prefill chunks of up to this many tokens group whatever padding they add (see _prefill_groups)
SHORT_ROW = 8  # ... or at most PADDED_WASTE x this many blocks a row: short rows are copied padded whatever
# they read (PADDED_WASTE = 0 reads every decode over blocks)


@dataclass(frozen=True)
class Prefills:
    """Chunks of more than one token attended together: P chunks padded to the longest, Q queries and K keys.

    Query i of chunk p is batch row index[p, i] at position cached[p] + i; it sees columns
    0 .. cached[p] + i. A padding query (i >= n[p]) repeats the chunk's last one and is not written back."""

    index: torch.Tensor  # [P, Q]: the batch row of each query
    valid: torch.Tensor  # [P, Q] bool: a real query
    table: torch.Tensor  # [P, W] block tables (padded with block 0)
    fresh: bool  # every chunk is a fresh prompt (nothing cached before it): given the new keys, it attends
    # to those (K = Q columns), no gather
    mask: torch.Tensor  # [P, 1, Q, W * block size] bool: True may attend (its first K columns are used)


@dataclass(frozen=True)
class Shared:
    """Decode rows (indices into the batch) whose first len(blocks) blocks are these same blocks."""

    rows: torch.Tensor  # [m]
    blocks: torch.Tensor  # [P]


@dataclass(frozen=True)
class RaggedBatch:
    """The N new tokens of one iteration, decode rows first (see the module docstring)."""

    tokens: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]: cache column = position in its sequence
    write_blocks: torch.Tensor  # [N]
    write_rows: torch.Tensor  # [N]: row inside the block
    last: torch.Tensor  # [R]: index of the last token of each chunk that samples, in the order of the chunks
    decodes: int  # D: tokens 0 .. D-1 are decode rows
    reads: tuple | None  # decode rows' own blocks (after a shared prefix): (blocks [B], rows [B], valid [B, bs]),
    # or padded (table [D, W], visible [D, 1, 1, W * bs]) when that copies little more (PADDED_WASTE)
    prefills: tuple[Prefills, ...]  # the longer chunks, in groups of similar sizes
    shared: tuple[Shared, ...] = ()  # decode rows whose leading blocks are the same blocks (cascade)

    @classmethod
    def build(cls, chunks: list[Chunk], block_size: int, device: Any) -> "RaggedBatch":
        """The batch of `chunks`: one-token chunks first; `last` follows the order of `chunks`."""
        ones = [c for c in chunks if c.n == 1]
        longer = [c for c in chunks if c.n > 1] if len(ones) < len(chunks) else []
        ordered = ones + longer
        seqs = [c.seq for c in ones]
        tokens = [s.pending[0] for s in seqs]  # a decode row: one token at its cached column
        positions = [s.cached for s in seqs]
        blocks = [s.blocks[p // block_size] for s, p in zip(seqs, positions)]
        if longer:
            ends = {id(c): i for i, c in enumerate(ones)}
            for c in longer:
                tokens += c.seq.pending[:c.n]
                span = range(c.seq.cached, c.seq.cached + c.n)
                positions += span
                blocks += [c.seq.blocks[p // block_size] for p in span]
                ends[id(c)] = len(tokens) - 1
            last = [ends[id(c)] for c in chunks if c.samples]
        else:  # one-token chunks only: the batch's rows are the chunks, in order
            last = [i for i, c in enumerate(ones) if c.samples]
        parts = [tokens, positions, blocks, [p % block_size for p in positions], last]
        packed = _tensor("q", [v for part in parts for v in part]).to(device).split([len(p) for p in parts])
        decodes = len(ones)
        skip, shared = _shared_prefixes(ordered[:decodes], block_size, device)
        reads = _decode_reads(ordered[:decodes], skip, block_size, device)
        prefills = _prefill_groups(ordered[decodes:], decodes, block_size, device)
        return cls(*packed, decodes, reads, prefills, shared)

    def write(self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' k / v [N, kv, d] in their blocks' rows."""
        keys[self.write_blocks, self.write_rows] = k
        values[self.write_blocks, self.write_rows] = v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor | None = None,
               v: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the new queries q [N, heads, d] over their sequences' cached keys: [N, heads, d].

        The keys are gathered here through the block tables; the kernels are `phyai_ray.nn.attention`'s.
        Given the new tokens' own k / v [N, kv, d] (what `write` stored), a chunk with nothing cached
        before it (a fresh prompt) attends to them directly: the same keys, no gather."""
        out = q.new_empty(q.shape)
        if self.decodes:
            out[:self.decodes] = self._decode(q[:self.decodes], keys, values)
        for g in self.prefills:
            if g.fresh and k is not None and v is not None:  # their own new keys, as `write` stored them
                pk, pv = k[g.index].transpose(1, 2), v[g.index].transpose(1, 2)
            else:
                pk, pv = _gather(keys, g.table), _gather(values, g.table)
            rows = q[g.index].transpose(1, 2)  # [P, H, Q, D]
            attended = attention(rows, pk, pv, g.mask[..., :pk.shape[2]]).transpose(1, 2)
            out[g.index[g.valid]] = attended[g.valid]
        return out


    def _decode(self, dq: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        prefixes = ((s.rows, _gather(keys, s.blocks[None]), _gather(values, s.blocks[None]))
                    for s in self.shared)  # gathered one group at a time
        if len(self.reads) == 2:  # padded: the rows' blocks copied, SDPA (or the cascade) over the copy
            table, visible = self.reads
            k, v = _gather(keys, table), _gather(values, table)
            if self.shared:
                return cascade_attention(dq, k, v, visible, prefixes)
            return decode_attention(dq, k, v, visible)
        if self.shared:
            own, lse = paged_attention_lse(dq, keys, values, *self.reads)
            return cascade_merge(dq, own, lse, prefixes)
        return paged_decode_attention(dq, keys, values, *self.reads)


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache [blocks, bs, kv, d] through tables [R, W] -> [R, kv, W * bs, d]: each row's columns in order.

    One copy (the gather of whole blocks, each contiguous); the head axis is moved by a view, which
    attention reads strided (a second, permuting copy cost as much as the gather itself)."""
    rows, width = table.shape
    blocks, bs, kv, d = cache.shape
    picked = cache.view(blocks, bs * kv * d).index_select(0, table.reshape(-1))  # 4-7x faster on a CPU than
    return picked.view(rows, width * bs, kv, d).transpose(1, 2)  # cache[table], which indexes element-wise


def _shared_prefixes(chunks: list[Chunk], block_size: int, device: Any) -> tuple[list[int], tuple[Shared, ...]]:
    """Groups of decode rows that hold the same leading blocks (the same first block: prefix caching
    shares a block only with its whole prefix), and per row how many leading blocks its group reads
    for it. A group's prefix ends where its rows' tables first differ, and never past a block some
    row has not finished writing (every shared block is full and already written)."""
    skip, by_first = [0] * len(chunks), {}
    firsts = [c.seq.blocks[0] if c.seq.blocks else -1 - i for i, c in enumerate(chunks)]
    if len(set(firsts)) == len(firsts):  # no two rows start with the same block: nothing is shared
        return skip, ()
    for i, first in enumerate(firsts):
        if first >= 0:
            by_first.setdefault(first, []).append(i)
    shared = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        tables = [chunks[i].seq.blocks for i in rows]
        limit = min(chunks[i].seq.cached for i in rows) // block_size
        n = 0
        while n < limit and all(t[n] == tables[0][n] for t in tables):
            n += 1
        if n:
            for i in rows:
                skip[i] = n
            shared.append(Shared(torch.tensor(rows, device=device), torch.tensor(tables[0][:n], device=device)))
    return skip, tuple(shared)


def _decode_reads(chunks: list[Chunk], skip: list[int], block_size: int, device: Any) -> tuple | None:
    """The blocks decode rows read after their first `skip` ones: (blocks [B], rows [B], valid [B, bs]),
    only as many blocks as each row's length needs, its columns past that length not valid."""
    if not chunks:
        return None
    lengths = [c.seq.cached + 1 - n * block_size for c, n in zip(chunks, skip)]  # own columns, the new token's in
    counts = [-(-length // block_size) for length in lengths]  # own blocks of each row
    width, total = max(counts), sum(counts)
    if len(chunks) * width <= PADDED_WASTE * max(total, len(chunks) * SHORT_ROW):
        return _padded(chunks, skip, lengths, counts, width, block_size, device)
    blocks, rows, columns = [], [], []
    for i, (c, n, length, count) in enumerate(zip(chunks, skip, lengths, counts)):
        blocks += c.seq.blocks[n:n + count]
        rows += [i] * count
        columns += [length - j * block_size for j in range(count)]  # its columns from this block on
    valid = torch.arange(block_size)[None, :] < _tensor("q", columns)[:, None]
    return _tensor("q", blocks).to(device), _tensor("q", rows).to(device), valid.to(device)


def _padded(chunks: list[Chunk], skip: list[int], lengths: list[int], counts: list[int], width: int, block_size: int,
            device: Any) -> tuple:
    """(table [D, width], visible [D, 1, 1, width * bs]): each row's own blocks padded with block 0,
    and which columns lie within its length."""
    table: list[int] = []
    for c, n, count in zip(chunks, skip, counts):
        table += c.seq.blocks[n:n + count]
        table += [0] * (width - count)
    visible = torch.arange(width * block_size)[None, :] < _tensor("q", lengths)[:, None]
    return _tensor("q", table).view(len(chunks), width).to(device), visible.view(len(chunks), 1, 1, -1).to(device)


def _prefill_groups(chunks: list[Chunk], start: int, block_size: int, device: Any) -> tuple[Prefills, ...]:
    """The longer chunks (batch rows from `start` on, in order) in groups attended together: by length, a
    group takes the next chunk while its padded queries x keys stay within PADDED_WASTE times its own
    (or SHORT_CHUNK squared a chunk: short prompts cost little padded). Fresh prompts group apart from
    chunks with cached columns (those read the cache through their tables)."""
    firsts, at = [], start
    for c in chunks:
        firsts.append(at)
        at += c.n
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].seq.cached > 0, chunks[i].seq.cached + chunks[i].n))
    groups, group = [], []
    for i in order:
        c = chunks[i]
        if group:
            head = chunks[group[0]]
            members = [chunks[j] for j in group] + [c]
            padded = len(members) * max(m.n for m in members) * (c.seq.cached + c.n)
            own = sum(m.n * (m.seq.cached + m.n) for m in members)
            if (head.seq.cached > 0) != (c.seq.cached > 0) or padded > max(PADDED_WASTE * own,
                                                                             len(members) * SHORT_CHUNK ** 2):
                groups.append(group)
                group = []
        group.append(i)
    if group:
        groups.append(group)
    return tuple(_prefills([chunks[i] for i in g], [firsts[i] for i in g], block_size, device) for g in groups)


def _prefills(chunks: list[Chunk], firsts: list[int], block_size: int, device: Any) -> Prefills:
    counts = _tensor("q", [c.n for c in chunks])
    cached = _tensor("q", [c.seq.cached for c in chunks])
    width = int(counts.max())
    query = torch.arange(width)
    valid = query[None, :] < counts[:, None]
    index = _tensor("q", firsts)[:, None] + torch.minimum(query[None, :], counts[:, None] - 1)
    sees = cached[:, None] + torch.minimum(query[None, :], counts[:, None] - 1)  # [P, Q]: the last column seen
    used = [-(-(c.seq.cached + c.n) // block_size) for c in chunks]
    w = max(used)
    table = _tensor("q", [b for c, u in zip(chunks, used) for b in c.seq.blocks[:u] + [0] * (w - u)])
    mask = torch.arange(w * block_size)[None, None, :] <= sees[:, :, None]
    return Prefills(index.to(device), valid.to(device), table.view(len(chunks), w).to(device),
                    not any(c.seq.cached for c in chunks), mask[:, None].to(device))
