"""Running sequences over a paged KV cache: waiting for blocks, preemption, chunked prefill, prefix reuse.

    paged = PagedSequences(pool, max_seq=256, vocab=360, token_budget=2048)
    paged.admit(7, payload)          # waits until blocks for its first chunk are free
    chunks = paged.schedule()        # this iteration's work: [Chunk(seq, n tokens, samples?)]
    ...one forward of the chunks' tokens (`ragged.RaggedBatch`), logits of the chunks that sample...
    deltas = paged.finish(chunks, chosen, log_probs, tops)   # {seq_id: Delta}; ended ones free their blocks

`schedule()` spends at most `token_budget` new tokens, in this order (no randomness, no timing, so
every rank makes the same choices from the same plans):

1. running sequences with ONE new token (decodes) go first: they never stall behind a long prompt;
2. running sequences part way through a prompt (or a rebuild) take the next chunk that fits;
3. waiting sequences, oldest admission first, start while the free blocks hold their first chunk
   (a full cached prefix is taken from the prefix cache, not computed); the first that does not
   fit stops the rest, so nothing overtakes it. None starts in an iteration that preempted one
   (the blocks just freed would go straight back to a sequence that must soon give them up).
   An engine whose admission reads `capacity()` (`plugins.admission.KVBlocks`) admits only what
   starts at once, so the waiting ones are preempted (or rebuilt) ones; `held` counts admitted
   sequences left unstarted after a schedule (0 then).

A running sequence that needs a block when none is free preempts the NEWEST running sequence not
yet scheduled in this iteration (its blocks freed; it goes back to waiting with its whole history to
recompute; its generator goes on, so its tokens are unchanged). A decode with nobody left to preempt
preempts itself. Budget 8, block size 4, a 10-token prompt alone: chunks of 8 then 2 (the second
samples); with two decoding sequences beside it: 1 + 1 + 6, then 1 + 1 + 4.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from phyai_ray.llm.blocks import BlockPool, blocks_for, chain_hash
from phyai_ray.llm.sequence import Running
from phyai_ray.plugins.iteration import Delta, KVReport


@dataclass(eq=False)
class PagedSeq(Running):
    """A `Running` sequence with a block table: `pending` is fed from column `cached` on."""

    order: int = 0  # admission order: smaller is older
    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of blocks[:len(hashes)] (full, registered)
    epoch: int = -1  # the pool epoch its cache was built in; another: its blocks are never registered
    preempted: int = 0  # preemptions not yet reported in a Delta
    started: bool = False  # it has had a first chunk (a waiting one that started is a preempted one)

    @property
    def history(self) -> list[int]:
        """Every token with a cache column (or about to have one): the prompt, then the generated ones."""
        return self.prompt + self.tokens

    def reported(self) -> int:
        """Its preemptions since the last call: what its next Delta reports."""
        count, self.preempted = self.preempted, 0
        return count

    def restart(self) -> None:
        """Forget the cache: the whole history is fed again (a rebuild or a preemption)."""
        self.cached, self.pending, self.hashes = 0, self.history, []


class Chunk(NamedTuple):
    """`n` of `seq.pending`'s tokens, fed at columns seq.cached ..; `samples` when they end the pending run.
    (A named tuple: one is made per running sequence per iteration.)"""

    seq: PagedSeq
    n: int
    samples: bool


class PagedSequences:
    """The waiting and running sequences of one loop over one `BlockPool` (see the module docstring)."""

    def __init__(self, pool: BlockPool, *, max_seq: int, vocab: int, token_budget: int, stop_scan: Any = None) -> None:
        if token_budget < 1:
            raise ValueError(f"PagedSequences: token_budget must be >= 1, got {token_budget}")
        if blocks_for(max_seq, pool.block_size) > pool.num_blocks:
            raise ValueError(f"the KV cache holds {pool.num_blocks} blocks of {pool.block_size} tokens, fewer than "
                             f"one sequence of max_model_len={max_seq} needs; raise the cache budget or lower "
                             "max_model_len")
        self.pool, self.max_seq, self.vocab, self.budget = pool, max_seq, vocab, token_budget
        self.stop_scan = stop_scan
        self.waiting: list[PagedSeq] = []  # by admission order
        self.running: list[PagedSeq] = []  # by admission order: the last is the newest
        self.by_id: dict[int, PagedSeq] = {}
        self._admitted = 0
        self.preemptions = 0  # running sequences preempted so far
        self.waits = 0  # iterations in which the waiting head found too few free blocks
        self.held = 0  # admitted sequences left waiting, never started, after an iteration's schedule (summed)
        self.unreported: dict[int, PagedSeq] = {}  # sequences preempted since their last Delta

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def beside(self) -> "PagedSequences":
        """Sequences of their own on the SAME pool (a whole request's, `PagedDecoder.generate`): they
        take its free blocks and share its cached prefixes, and never preempt these."""
        return PagedSequences(self.pool, max_seq=self.max_seq, vocab=self.vocab, token_budget=self.budget,
                              stop_scan=self.stop_scan)

    def admit(self, seq_id: int, payload: dict[str, Any]) -> PagedSeq:
        seq = PagedSeq.admitted(seq_id, payload, max_seq=self.max_seq, vocab=self.vocab, running=self.by_id,
                                stop_scan=self.stop_scan)
        seq.order, self._admitted = self._admitted, self._admitted + 1
        self.waiting.append(seq)
        self.by_id[seq_id] = seq
        return seq

    def drop(self, seq_id: int) -> None:
        """Forget a sequence and free its blocks; an unknown id is ignored."""
        seq = self.by_id.pop(seq_id, None)
        if seq is not None:
            (self.running if seq in self.running else self.waiting).remove(seq)
            self._release(seq)

    def recompute(self, seq_id: int) -> None:
        """Rebuild the sequence's cache from its whole history (after a weight update): it waits again."""
        seq = self.by_id.get(seq_id)
        if seq is not None and seq in self.running:
            self._preempt(seq, count=False)
        elif seq is not None:
            seq.restart()

    def evict_all(self, count: bool = False) -> None:
        """Every running sequence back to waiting (its blocks freed, its history recomputed later): a
        sleep, or (`count`: reported as preemptions) a whole request that needs the blocks."""
        for seq in list(self.running):
            self._preempt(seq, count=count)

    # -- one iteration ---------------------------------------------------------------------------
    def schedule(self) -> list[Chunk]:
        """This iteration's chunks, decodes first (see the module docstring)."""
        chunks: list[Chunk] = []
        left, preempted = self.budget, self.preemptions
        scheduled: set[int] = set()
        size, naming = self.pool.block_size, self.pool.prefix_caching
        prefills = []
        for seq in tuple(self.running):  # the decodes: one token each, the hot path (no call per sequence
            if len(seq.pending) != 1:  # unless it needs a block or fills one)
                prefills.append(seq)
                continue
            if left == 0:
                break
            if self.preemptions != preempted and seq not in self.running:  # preempted by an older one this round
                continue
            if seq.cached >= len(seq.blocks) * size and not self._grow(seq, 1, scheduled):
                continue
            chunks.append(Chunk(seq, 1, True))
            scheduled.add(seq.seq_id)
            if naming and (seq.cached + 1) // size > len(seq.hashes):
                self._name_full_blocks(seq, seq.cached + 1)
            left -= 1
        for seq in prefills:
            if left == 0:
                break
            if self.preemptions != preempted and seq not in self.running:
                continue
            n = self._grow(seq, min(left, len(seq.pending)), scheduled)
            if n:
                chunks.append(Chunk(seq, n, n == len(seq.pending)))
                scheduled.add(seq.seq_id)
                self._name_full_blocks(seq, seq.cached + n)
                left -= n
        while self.waiting and left and self.preemptions == preempted:  # none started beside a preemption
            n = self._start(self.waiting[0], left)
            if not n:  # the free blocks cannot hold one token of it
                self.waits += 1
                break
            seq = self.waiting.pop(0)
            seq.started = True
            chunks.append(Chunk(seq, n, n == len(seq.pending)))
            self._name_full_blocks(seq, seq.cached + n)
            self._run(seq)
            left -= n
        self.held += sum(1 for s in self.waiting if not s.started)
        return chunks

    def capacity(self) -> KVReport:
        """What a new sequence may take in the next iteration (`KVReport`): the free blocks less what these
        sequences need for their pending tokens (a preempted one: its whole history), and those tokens."""
        size, need, tokens = self.pool.block_size, 0, 0
        for seq in self.running:
            need += max(blocks_for(seq.cached + len(seq.pending), size) - len(seq.blocks), 0)
            tokens += len(seq.pending)
        for seq in self.waiting:
            need += blocks_for(seq.cached + len(seq.pending), size)
            tokens += len(seq.pending)
        return KVReport(free_blocks=max(self.pool.free_count - need, 0), block_size=size, busy_tokens=tokens,
                        token_budget=self.budget)

    def finish(self, chunks: list[Chunk], chosen: list[int], log_probs: list[float],
               tops: list[dict[int, float] | None] | None = None) -> dict[int, Delta]:
        """After the forward: the sampling chunks take chosen[i] (in order), the others advance; the
        sequences that ended free their blocks. Every sequence held gets a Delta (an empty one when it
        ran no chunk), carrying the preemptions it has not reported yet."""
        sampled = iter(zip(chosen, log_probs, tops or [None] * len(chosen)))
        deltas: dict[int, Delta] = {}
        ended = []
        for seq, n, samples in chunks:
            if samples:
                deltas[seq.seq_id] = seq.take(*next(sampled))
                if seq.stop_reason is not None:
                    ended.append(seq)
            else:
                seq.cached += n
                seq.pending = seq.pending[n:]
                deltas[seq.seq_id] = Delta()
        if ended:
            gone = {id(seq) for seq in ended}
            self.running = [s for s in self.running if id(s) not in gone]
            for seq in ended:
                del self.by_id[seq.seq_id]
                self._release(seq)
        return self.report(deltas, ended)

    def report(self, deltas: dict[int, Delta], ended: list[PagedSeq] = ()) -> dict[int, Delta]:
        """`deltas` with an empty Delta for every other sequence held, and each one's unreported preemptions."""
        if len(deltas) != len(self.by_id) + len(ended):
            for seq_id in self.by_id.keys() - deltas.keys():
                deltas[seq_id] = Delta()
        if self.unreported:
            for seq_id, seq in self.unreported.items():
                if seq_id in deltas:  # (not a dropped one)
                    deltas[seq_id].preempted += seq.reported()
            self.unreported = {}
        return deltas

    # -- blocks ----------------------------------------------------------------------------------
    def _grow(self, seq: PagedSeq, n: int, scheduled: set[int]) -> int:
        """Blocks for n more tokens of a running sequence, preempting newer ones when none is free;
        the tokens it got (fewer when a prefill's blocks ran out; 0: it preempted itself or waits)."""
        need = blocks_for(seq.cached + n, self.pool.block_size) - len(seq.blocks)
        if need <= 0:  # its blocks hold them (a decode, 15 of every 16 tokens at block size 16)
            return n
        while need > self.pool.free_count:
            victim = next((s for s in reversed(self.running) if s is not seq and s.seq_id not in scheduled), None)
            if victim is None:
                break
            self._preempt(victim)
        if need > self.pool.free_count:
            if n == 1:
                self._preempt(seq)
                return 0
            n = (len(seq.blocks) + self.pool.free_count) * self.pool.block_size - seq.cached
            need = self.pool.free_count
        seq.blocks += [self.pool.allocate() for _ in range(max(need, 0))]
        return max(n, 0)

    def _start(self, seq: PagedSeq, left: int) -> int:
        """Give a waiting sequence its cached prefix and the blocks of its first chunk (at most `left`
        tokens); 0 (and nothing taken) when the free blocks cannot hold a chunk of one token."""
        found = self._cached_prefix(seq)
        size = self.pool.block_size
        n = min(left, len(seq.pending) - len(found) * size)
        reclaimed = sum(1 for b in found if self.pool.refs[b] == 0)  # cached blocks on the free list
        need = blocks_for(len(found) * size + n, size) - len(found)
        room = self.pool.free_count - reclaimed
        if need > room:
            n = min(n, room * size)
            need = blocks_for(n, size) if n > 0 else 0
        if n <= 0:
            return 0
        for block in found:
            self.pool.share(block)
        self.pool.queries += len(seq.pending) - 1
        self.pool.hits += len(found) * size
        seq.blocks = found + [self.pool.allocate() for _ in range(need)]
        seq.cached, seq.pending = len(found) * size, seq.pending[len(found) * size:]
        seq.epoch = self.pool.epoch
        return n

    def _cached_prefix(self, seq: PagedSeq) -> list[int]:
        """The longest run of cached full blocks of the sequence's history, always leaving its last token to compute."""
        found: list[int] = []
        seq.hashes, parent, size = [], None, self.pool.block_size
        history = seq.pending  # a waiting sequence's pending is its whole history
        for j in range((len(history) - 1) // size):
            key = chain_hash(parent, history[j * size:(j + 1) * size])
            block = self.pool.lookup(key)
            if block is None:
                break
            found.append(block)
            seq.hashes.append(key)
            parent = key
        return found

    def _name_full_blocks(self, seq: PagedSeq, upto: int) -> None:
        """Name the blocks that columns 0 .. upto - 1 fill (caching on, the cache built in this epoch).

        Named when scheduled, before they are computed: a sequence starting later in the same
        iteration may share them, as every layer writes the whole batch's keys before any attends."""
        if not self.pool.prefix_caching or seq.epoch != self.pool.epoch:
            return
        size, history = self.pool.block_size, None
        while len(seq.hashes) < upto // size:
            history = history or seq.history
            j = len(seq.hashes)
            key = chain_hash(seq.hashes[-1] if seq.hashes else None, history[j * size:(j + 1) * size])
            self.pool.register(seq.blocks[j], key)
            seq.hashes.append(key)

    def _run(self, seq: PagedSeq) -> None:
        bisect.insort(self.running, seq, key=lambda s: s.order)

    def _preempt(self, seq: PagedSeq, count: bool = True) -> None:
        """Free a running sequence's blocks; it waits (by its admission order) to recompute its history."""
        self.running.remove(seq)
        self._release(seq)
        seq.restart()
        bisect.insort(self.waiting, seq, key=lambda s: s.order)
        self.preemptions += count
        seq.preempted += count
        if count:
            self.unreported[seq.seq_id] = seq

    def _release(self, seq: PagedSeq) -> None:
        self.pool.free(reversed(seq.blocks))
        seq.blocks = []
