"""The iteration protocol: plugins whose work is a loop of steps, batched per iteration.

A request is split into sequences (`Entry.sequences`); the replica runs ONE loop over every
running sequence of every request, and sequences join and leave between iterations:

    Entry.sequences(request)      -> [SequenceSpec(payload, cost), ...]      in the dispatcher
    per-rank model (every rank, the same plan, the same forward):
        admit(seq_id, payload)    a new sequence: its prefill runs in the next iterate()
        drop(seq_id)              forget a sequence (cancelled, past its deadline, aborted); free its slot
        recompute(seq_id)         the next iterate() rebuilds its cache from its whole history
                                  (prompt + every token so far) under the current weights
        iterate()                 -> {seq_id: Delta}: ONE iteration (prefill of the newly admitted,
                                  one step for the rest); a finished sequence frees its own slot
    Entry.gather(request, outputs) -> the request's result, from one `TokenOutput` per sequence

Every plan reaches every rank of the replica in the same order, so ranks that share collectives
run the same iterations; only the output rank's deltas are read. `RankRunner.iterate(plan)` applies
a plan: drops, then recomputes, then admits, then one `iterate()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ITERATION_METHODS = ("admit", "drop", "recompute", "iterate")


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence of a request: what `admit` receives, and its prefill cost in tokens."""

    payload: Any
    cost: int = 1  # tokens its first iteration processes (the prompt length), against max_num_batched_tokens


@dataclass
class Delta:
    """What one iteration produced for one sequence: new tokens, their log-probs, and whether it ended.

    `stop_reason` is None while the sequence runs, else "completed" or "length" (its slot is free).
    A chunked prefill may return an empty delta. `top_logprobs`, when the sequence asked for k of
    them, holds per token its k most likely tokens {token id: log-prob}; empty otherwise.
    `value`: a sequence whose output is not tokens (a denoised action chunk) gives it with its last
    delta; `Entry.gather` then receives that value for the sequence instead of a `TokenOutput`.
    """

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    value: Any = None


@dataclass(frozen=True)
class IterationPlan:
    """What every rank does before one iteration: the same plan, in the same order, everywhere."""

    admit: tuple[tuple[int, Any], ...] = ()  # (seq_id, payload)
    drop: tuple[int, ...] = ()
    recompute: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.admit or self.drop or self.recompute)


def is_iterative(model: Any) -> bool:
    """Whether a per-rank model implements the iteration protocol (every method of it)."""
    return all(callable(getattr(model, name, None)) for name in ITERATION_METHODS)
