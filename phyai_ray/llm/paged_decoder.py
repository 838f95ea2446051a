"""`PagedDecoder`: the one decoder of the LLM runtime, over the one KV cache (a `BlockPool`).

A per-rank decoder (`reference_lm`, `hf_causal_lm`) subclasses it and supplies three things:

    self.paged                     the protocol's `PagedSequences` over its `BlockPool` (built at load)
    parse(request)                 -> a request with `prompts`, `max_tokens` and `payloads()` (one per prompt)
    logits(batch, pool)            -> [R, vocab] at `batch.last` (one forward of a `RaggedBatch`)

Every generation runs through one loop, `run(seqs)`:

    chunks = seqs.schedule()              decodes first, then prompt chunks, then starts
    batch = RaggedBatch.build(chunks)     the new tokens, unpadded
    logits -> sample -> seqs.finish()     one Delta per sequence; ended ones free their blocks

The iteration protocol (`admit` / `drop` / `recompute` / `iterate`) runs it over `self.paged`, the
replica's sequences. A whole request (`step` / `stream`) runs it over sequences of its own on the
SAME pool (`PagedSequences.beside`): its prompts are admitted, iterated until they end, and their
blocks freed. They never preempt the protocol's sequences, except when the free blocks cannot hold
one token of the request: then the protocol's running sequences give their blocks back (they
recompute their history at their next iteration, their tokens unchanged). Every prompt of a
checked request fits the pool alone (`PagedSequences` refuses a pool smaller than `max_seq`).

A sequence that waits for blocks, or whose prompt is part way through, gets an empty Delta.
A forward that raises forgets every cached prefix (its blocks were named before they were written).
After the reductions every rank holds the same logits, so every rank samples the same token from
the same seeded generator.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from phyai_ray.llm.blocks import BlockPool
from phyai_ray.llm.paged import PagedSequences
from phyai_ray.llm.ragged import RaggedBatch
from phyai_ray.llm.sampler import draw
from phyai_ray.outputs import TokenOutput, token_chunk
from phyai_ray.plugins.iteration import Delta, Deltas


class PagedDecoder:
    """The iteration protocol, `step` / `stream` of whole requests, and the cache's sleep and reset."""

    ctx: Any
    paged: PagedSequences
    weight_version: Any = None  # set by the engine after every weight update
    forward_s = 0.0  # seconds of the model's forward in the latest iterate() (Deltas.forward_s)

    def parse(self, request: Any) -> Any:
        raise NotImplementedError

    def logits(self, batch: RaggedBatch, pool: BlockPool) -> torch.Tensor:
        raise NotImplementedError

    # -- the iteration protocol ------------------------------------------------------------------
    @torch.inference_mode()
    def admit(self, seq_id: int, payload: dict[str, Any]) -> None:
        """A new sequence; it starts (its prompt in chunks) in the next iteration when blocks for its first
        chunk are free (an engine whose admission reads `iterate()`'s `KVReport` admits only such). A
        payload's "token_budget" (the engine's BatchingConfig.max_num_batched_tokens, as its admission
        counted it) becomes the budget of every later iteration."""
        budget = payload.get("token_budget")
        if budget is not None:
            self.paged.budget = int(budget)
        self.paged.admit(seq_id, payload)

    @torch.inference_mode()
    def drop(self, seq_id: int) -> None:
        """Forget a sequence and free its blocks; an unknown (finished, dropped) id is ignored."""
        self.paged.drop(seq_id)

    @torch.inference_mode()
    def recompute(self, seq_id: int) -> None:
        """Rebuild the sequence's cache from its whole history under the current weights (in chunks,
        from the next iterate() on); its generator goes on. Unknown ids are ignored."""
        self.paged.recompute(seq_id)

    @torch.inference_mode()
    def iterate(self) -> Deltas:
        """One forward of this iteration's chunks: {seq_id: Delta} for every sequence it holds, with the
        cache's `KVReport` after it (`PagedSequences.capacity`) for the engine's admission."""
        self.forward_s = 0.0
        return Deltas(self.run(self.paged)[0], capacity=self.paged.capacity(), forward_s=self.forward_s)

    # -- whole requests --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, request: Any) -> list[TokenOutput] | None:
        outputs = self.generate(self.parse(request))
        return outputs if self.ctx.is_output_rank else None

    @torch.inference_mode()
    def stream(self, request: Any, emit: Any) -> list[TokenOutput]:
        """Like step, emitting {"index": t, "token_ids": [...], "log_probs": [...]} per iteration that
        gave a token (None for prompts without one); stops on every rank when `emit` returns False."""
        return self.generate(self.parse(request), emit)

    def generate(self, req: Any, emit: Any = None) -> list[TokenOutput]:
        """Every prompt as a sequence beside the protocol's, on the same pool, iterated to the end."""
        own = self.paged.beside()
        seqs = [own.admit(i, payload) for i, payload in enumerate(req.payloads())]
        preempted, index = [0] * len(seqs), 0
        try:
            while own:
                deltas = self._advance(own)
                for i, d in deltas.items():
                    preempted[i] += d.preempted
                if not any(d.token_ids for d in deltas.values()):
                    continue
                if emit is not None and emit(token_chunk(index, [deltas.get(i) for i in range(len(seqs))])) is False:
                    break
                index += 1
        finally:
            for seq in seqs:  # aborted or failed: its blocks go back to the pool
                own.drop(seq.seq_id)
        return [TokenOutput(s.tokens, s.log_probs, stop_reason=s.stop_reason or "aborted", num_preempted=n,
                            weight_version=self.weight_version, top_logprobs=s.tops) for s, n in zip(seqs, preempted)]

    def _advance(self, own: PagedSequences) -> dict[int, Delta]:
        """One iteration of a whole request's sequences; when the free blocks hold none of them, the
        protocol's running sequences give theirs back first (module docstring)."""
        first, ran = self.run(own)
        if ran or not own:
            return first
        self.paged.evict_all(count=True)
        deltas, ran = self.run(own)
        if not ran and own:
            raise RuntimeError(f"the KV cache's {own.pool.free_count} free block(s) of {own.pool.num_blocks} "
                               f"hold no token of the request's {len(own.waiting)} waiting sequence(s)")
        for seq_id, d in first.items():
            deltas[seq_id].preempted += d.preempted
        return deltas

    # -- the one loop ----------------------------------------------------------------------------
    def run(self, seqs: PagedSequences) -> tuple[dict[int, Delta], bool]:
        """One forward of `seqs`' scheduled chunks: ({seq_id: Delta} for every sequence it holds,
        whether any chunk ran)."""
        seqs.pool.restore()  # after a sleep whose wake_up did not name "kv_cache"
        chunks = seqs.schedule()
        if not chunks:
            return seqs.report({}), False
        try:
            batch = RaggedBatch.build(chunks, seqs.pool.block_size, self.ctx.device)
            started = time.perf_counter()
            logits = self.logits(batch, seqs.pool)
            if logits.is_cuda:  # the forward's own time (loop_timing): until the device has finished it
                torch.cuda.synchronize(logits.device)
            self.forward_s += time.perf_counter() - started
        except BaseException:
            seqs.pool.reset()  # blocks named for this iteration hold no valid keys: never find them
            raise
        sampling = [c.seq for c in chunks if c.samples]
        chosen, log_probs, tops = draw(logits, sampling) if sampling else ([], [], None)  # one copy to the host
        return seqs.finish(chunks, chosen, log_probs, tops), True

    # -- the cache -------------------------------------------------------------------------------
    def cache_bytes(self) -> int:
        """Bytes the KV pool's tensors hold now (0 once released)."""
        pool = self.paged.pool
        return sum(t.numel() * t.element_size() for t in pool.keys + pool.values)

    def release_cache(self) -> None:
        """Free the KV blocks' memory (sleep): running sequences wait again, to recompute their history."""
        self.paged.evict_all()
        self.paged.pool.release()

    def restore_cache(self) -> None:
        """Allocate the KV blocks again (wake_up "kv_cache"), every name forgotten."""
        self.paged.pool.restore()
        self.paged.pool.reset()

    def reset_cache(self) -> None:
        """After a weight update: no cached prefix is found again (running sequences keep their
        blocks; the engine decides which to `recompute`)."""
        self.paged.pool.reset()

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prefix-cache tokens looked up and reused, blocks free and cached, preemptions and waits so far,
        and `held`: admitted sequences left waiting unstarted after an iteration (0 under `KVBlocks`)."""
        return {**self.paged.pool.stats(), "preemptions": self.paged.preemptions,
                "waits": self.paged.waits, "held": self.paged.held, "token_budget": self.paged.budget,
                "waiting": len(self.paged.waiting), "running": len(self.paged.running)}
