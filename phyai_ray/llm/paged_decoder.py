"""`PagedDecoder`: the iteration protocol of a decoder over the paged KV cache (`paged.PagedSequences`).

A per-rank decoder mixes it in before `SlotDecoder` (whose `step` / `stream` of whole requests
stay on `Slots`) and supplies two things:

    self.paged                     the `PagedSequences` over its `BlockPool` (built at load)
    logits(batch, pool)            -> [R, vocab] at `batch.last` (one forward of a `RaggedBatch`)

    iterate():  chunks = paged.schedule()             decodes first, then prompt chunks, then starts
                batch = RaggedBatch.build(chunks)     the new tokens, unpadded
                logits -> sample -> paged.finish()    one Delta per scheduled sequence

A sequence that waits for blocks, or whose prompt is part way through, gets an empty Delta.
A forward that raises forgets every cached prefix (its blocks were named before they were written).
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray.llm.paged import PagedSequences
from phyai_ray.llm.ragged import RaggedBatch
from phyai_ray.llm.sampler import draw
from phyai_ray.plugins.iteration import Delta


class PagedDecoder:
    """admit / drop / recompute / iterate / reset_cache over `self.paged` (see the module docstring)."""

    ctx: Any
    paged: PagedSequences

    def logits(self, batch: Any, cache: Any) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def admit(self, seq_id: int, payload: dict[str, Any]) -> None:
        """A new sequence; it starts (its prompt in chunks) once blocks for its first chunk are free."""
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
    def iterate(self) -> dict[int, Delta]:
        """One forward of this iteration's chunks: {seq_id: Delta} for every sequence it holds."""
        paged = self.paged
        paged.pool.restore()  # after a sleep whose wake_up did not name "kv_cache"
        chunks = paged.schedule()
        deltas = {s.seq_id: Delta(preempted=s.reported()) for s in paged.by_id.values()}  # none preempted in chunks
        if not chunks:
            return deltas
        try:
            logits = self.logits(RaggedBatch.build(chunks, paged.pool.block_size, self.ctx.device), paged.pool)
        except BaseException:
            paged.pool.reset()  # blocks named for this iteration hold no valid keys: never find them
            raise
        seqs = [c.seq for c in chunks if c.samples]
        chosen, log_probs, tops = draw(logits, seqs) if seqs else ([], [], None)  # one copy to the host
        deltas.update(paged.finish(chunks, chosen, log_probs, tops))
        return deltas

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
        """Prefix-cache tokens looked up and reused, blocks free and cached, preemptions and waits so far."""
        return {**self.paged.pool.stats(), "preemptions": self.paged.preemptions,
                "waits": self.paged.waits,
                "waiting": len(self.paged.waiting), "running": len(self.paged.running)}

