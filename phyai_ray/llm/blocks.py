"""A paged KV cache: fixed-size blocks, reference counts, and automatic prefix caching.

    pool = BlockPool(num_blocks=64, block_size=16, layers=2, kv_heads=2, head_dim=16, to={"dtype": torch.float32})
    keys, values = pool.layer(0)            # each [num_blocks, block_size, kv_heads, head_dim]
    b = pool.allocate()                      # a free block, reference count 1
    pool.register(b, chain_hash(None, ids))  # a FULL block's tokens, findable by later sequences
    pool.share(pool.lookup(h))               # a later sequence with the same prefix: count 2, no compute
    pool.free([b])                           # count 0: back on the free list, still findable until reused

A sequence's token at position p lives in block `table[p // block_size]`, row `p % block_size`.
With block_size 4 and the table [7, 2], position 5 is row 1 of block 2.

Prefix caching (vLLM's automatic prefix caching): a full block is named by the hash of its parent
block's hash and its own token ids, so a hash stands for the whole prefix up to the block's end.
A block whose count falls to 0 stays on the free list with its hash: a later lookup can take it
back. `allocate` takes the least recently freed block (blocks without a hash first), and only
then does its hash stop naming it. `reset()` (after a weight update) forgets every hash: nothing
computed under the old weights is found again.

Every rank of a replica makes the same calls in the same order, so its pool holds the same blocks.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch

DEFAULT_BLOCK_SIZE = 16


class BlocksExhaustedError(RuntimeError):
    """`allocate()` found no free block: the caller should have checked `free_count` first."""


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The name of a full block: sha256 over its parent's name and its token ids (the same on every rank
    and in every process, unlike Python's `hash` of bytes; 32 bytes, so collisions are not a concern)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def block_bytes(*, layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over every layer, keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * block_size * head_dim * itemsize


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens: blocks_for(33, 16) == 3."""
    return math.ceil(tokens / block_size)


class BlockPool:
    """The KV blocks of every layer, the free list (an LRU), reference counts and the prefix-cache index."""

    def __init__(self, *, num_blocks: int, block_size: int, layers: int, kv_heads: int, head_dim: int,
                 to: dict[str, Any], prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool: num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.shape, self.to, self.layers = (num_blocks, block_size, kv_heads, head_dim), to, layers
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.restore()
        self.refs = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free_list: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self.epoch = 0  # bumped by reset(): a sequence built before it must not register its blocks
        self.hits = self.queries = 0  # prefix-cache tokens reused / looked up

    @property
    def free_count(self) -> int:
        """Blocks `allocate` can hand out (cached blocks nobody holds included)."""
        return len(self.free_list)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (keys, values), each [num_blocks, block_size, kv_heads, head_dim]: a block's rows are
        token positions, so a gather of blocks is already in column order (`ragged._gather`)."""
        return self.keys[i], self.values[i]

    def allocate(self) -> int:
        """The least recently freed block, count 1; its hash (if any) no longer finds it."""
        if not self.free_list:
            raise BlocksExhaustedError(f"no free KV block of {self.num_blocks}; check free_count before allocating")
        block, _ = self.free_list.popitem(last=False)
        self._forget(block)
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more holder of a cached block (taken back from the free list when nobody held it)."""
        if self.refs[block] == 0:
            del self.free_list[block]
        self.refs[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one holder of each block; a block nobody holds goes to the free list. Pass a sequence's
        table last block first: its tail (the least shared part of a prefix) is then reused first."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise RuntimeError(f"BlockPool.free: block {block} freed more often than allocated")
            if self.refs[block] == 0:
                self.free_list[block] = None
                if self.hash_of[block] is None:  # nothing to find in it: reuse it before any cached block
                    self.free_list.move_to_end(block, last=False)

    def lookup(self, key: bytes) -> int | None:
        """The block named `key`, if caching is on and it is still cached."""
        return self.by_hash.get(key) if self.prefix_caching else None

    def register(self, block: int, key: bytes) -> None:
        """Name a full block by its chain hash; the first block of a name keeps it."""
        if self.prefix_caching and key not in self.by_hash and self.hash_of[block] is None:
            self.by_hash[key] = block
            self.hash_of[block] = key

    @property
    def released(self) -> bool:
        return not self.keys

    def release(self) -> None:
        """Free the tensors (sleep); every block must be free. `restore()` allocates them again."""
        if self.free_count != self.num_blocks:
            raise RuntimeError(f"BlockPool.release: {self.num_blocks - self.free_count} block(s) still held")
        self.keys, self.values = [], []
        self.reset()

    def restore(self) -> None:
        """(Re)allocate every layer's tensors, zeros: a masked key's weight is 0, but 0 * NaN in an
        unwritten value would still be NaN."""
        if self.released:
            self.keys = [torch.zeros(self.shape, **self.to) for _ in range(self.layers)]
            self.values = [torch.zeros(self.shape, **self.to) for _ in range(self.layers)]

    def reset(self) -> None:
        """Forget every name (after a weight update): no block is found again; held blocks stay held."""
        self.by_hash.clear()
        self.hash_of = [None] * self.num_blocks
        self.epoch += 1

    def stats(self) -> dict[str, int]:
        """Prefix-cache tokens looked up and reused since load, and the blocks free and cached now."""
        return {"queries": self.queries, "hits": self.hits, "free_blocks": self.free_count,
                "cached_blocks": len(self.by_hash), "num_blocks": self.num_blocks, "block_size": self.block_size}

    def _forget(self, block: int) -> None:
        key = self.hash_of[block]
        if key is not None:
            self.hash_of[block] = None
            if self.by_hash.get(key) == block:
                del self.by_hash[key]
