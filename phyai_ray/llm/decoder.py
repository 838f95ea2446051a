"""`SlotDecoder`: the iteration protocol and whole-request generation of a decoder over `Slots`.

A per-rank decoder subclasses it and supplies three things; the rest is here, shared by
`reference_lm` and `hf_causal_lm`:

    parse(request)          -> a request with `prompts`, `max_tokens` and `payloads()` (one per prompt)
    new_slots(rows, max_seq) -> the `Slots` (KV cache rows) of its shape
    logits(batch, slots)    -> [B, vocab] at each row's last new token (one forward of the batch)

Every generation runs as sequences in `Slots`: the protocol's `admit` / `drop` / `recompute` /
`iterate` drive the replica's one loop over `self.slots`, and `step` / `stream` run a request's
prompts as sequences of a private `Slots`, the same code path. After the reductions every rank
holds the same logits, so every rank samples the same token from the same seeded generator.
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray.llm.sampler import draw
from phyai_ray.llm.slots import Batch, Slots
from phyai_ray.outputs import TokenOutput, token_chunk
from phyai_ray.plugins.iteration import Delta


class SlotDecoder:
    """Iteration protocol (`phyai_ray.plugins.iteration`) plus `step` / `stream` of whole requests."""

    ctx: Any
    slots: Slots
    weight_version: Any = None  # set by the engine after every weight update

    def parse(self, request: Any) -> Any:
        raise NotImplementedError

    def new_slots(self, rows: int, max_seq: int) -> Slots:
        raise NotImplementedError

    def logits(self, batch: Batch, slots: Slots) -> torch.Tensor:
        raise NotImplementedError

    def reset_cache(self) -> None:
        """Nothing: a request's cache ends with it, and running sequences keep theirs (the engine
        decides which to `recompute` after a weight update)."""

    # -- the iteration protocol ------------------------------------------------------------------
    @torch.inference_mode()
    def admit(self, seq_id: int, payload: dict[str, Any]) -> None:
        """A new sequence (the request's `payloads()` build it); its prefill runs in the next iterate()."""
        self.slots.admit(seq_id, payload)

    @torch.inference_mode()
    def drop(self, seq_id: int) -> None:
        """Forget a sequence and free its slot; an unknown (finished, dropped) id is ignored."""
        self.slots.drop(seq_id)

    @torch.inference_mode()
    def recompute(self, seq_id: int) -> None:
        """The next iterate() rebuilds the sequence's cache from its whole history under the current
        weights and samples its next token from it; its generator goes on. Unknown ids are ignored."""
        self.slots.recompute(seq_id)

    @torch.inference_mode()
    def iterate(self) -> dict[int, Delta]:
        """One forward of every running sequence: {seq_id: Delta([token], [log_prob], stop_reason)}."""
        return self.run_iteration(self.slots)

    # -- whole requests --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, request: Any) -> list[TokenOutput] | None:
        outputs = self.generate(self.parse(request))
        return outputs if self.ctx.is_output_rank else None

    @torch.inference_mode()
    def stream(self, request: Any, emit: Any) -> list[TokenOutput]:
        """Like step, emitting {"index": t, "token_ids": [...], "log_probs": [...]} per iteration
        (None for prompts already finished); stops on every rank when `emit` returns False."""
        return self.generate(self.parse(request), emit)

    def generate(self, req: Any, emit: Any = None) -> list[TokenOutput]:
        """Every prompt as a sequence of a private `Slots` (the protocol's are untouched), iterated to the end."""
        slots = self.new_slots(rows=len(req.prompts), max_seq=max(len(p) for p in req.prompts) + req.max_tokens)
        seqs = [slots.admit(i, payload) for i, payload in enumerate(req.payloads())]
        index = 0
        while slots.rows:
            deltas = self.run_iteration(slots)
            if emit is not None and emit(token_chunk(index, [deltas.get(i) for i in range(len(seqs))])) is False:
                break
            index += 1
        return [TokenOutput(s.tokens, s.log_probs, stop_reason=s.stop_reason or "aborted",
                            weight_version=self.weight_version, top_logprobs=s.tops) for s in seqs]

    def run_iteration(self, slots: Slots) -> dict[int, Delta]:
        if not slots.rows:
            return {}
        batch = slots.batch(self.ctx.device)
        logits = self.logits(batch, slots)
        chosen, log_probs, tops = draw(logits, slots.rows)  # on the logits' device; one copy to the host
        return slots.advance(chosen, log_probs, tops)
