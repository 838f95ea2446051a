"""What the iteration loop keeps per request and per sequence.

    LoopRequest     a request: its future, deadline, sequences left, and stream sink if streamed
    LoopSequence    a sequence: its payload and prefill cost, tokens / log-probs / per-token versions so far
    stream_chunk    one iteration's chunk of a streamed request: {"index", "token_ids", "log_probs"}
"""

from __future__ import annotations

import time
from typing import Any

from phyai_ray.executors.futures import EngineFuture
from phyai_ray.outputs import TokenOutput, token_chunk
from phyai_ray.plugins.iteration import Delta
from phyai_ray.streams import ChunkSink


class LoopRequest:
    """One request of the loop: its future, its sequences, its deadline and its stream (if any)."""

    __slots__ = ("payload", "future", "seqs", "deadline", "submitted", "sink", "left", "admitted", "chunks", "due",
                 "order")

    def __init__(self, payload: Any, future: EngineFuture, limit_s: float, sink: ChunkSink | None,
                 due: float | None = None) -> None:
        self.payload, self.future, self.sink = payload, future, sink
        self.submitted = time.monotonic()
        self.deadline = self.submitted + limit_s
        self.due = due  # its own deadline: not admitted by then, it is answered DeadlineMissedError
        self.order = due if due is not None else self.deadline  # earliest-deadline-first key
        self.seqs: list[LoopSequence] = []
        self.left = 0  # sequences not ended yet
        self.admitted = False  # some sequence reached the ranks
        self.chunks = 0


class LoopSequence:
    """One sequence: what its rank admits, and the tokens, log-probs and weight versions it has so far."""

    __slots__ = ("ident", "request", "index", "payload", "cost", "tokens", "log_probs", "versions", "stop_reason",
                 "cache_version", "stale", "state", "tops", "value")

    def __init__(self, ident: int, request: LoopRequest, index: int, payload: Any, cost: int) -> None:
        self.ident, self.request, self.index, self.payload, self.cost = ident, request, index, payload, cost
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[Any] = []
        self.tops: list[dict[int, float]] = []  # per token, when the sequence asked for alternatives
        self.stop_reason: str | None = None
        self.value: Any = None  # a non-token sequence's result (Delta.value)
        self.cache_version: Any = None
        self.stale = False  # its cache must be rebuilt at its next iteration
        self.state = "waiting"  # -> "running" (it has a slot) -> "done" (ended, or its request left)

    @property
    def order(self) -> float:
        return self.request.order

    def output(self) -> Any:
        """What `Entry.gather` receives for this sequence: its `Delta.value` if it gave one, else a TokenOutput."""
        if self.value is not None:
            return self.value
        return TokenOutput(self.tokens, self.log_probs, stop_reason=self.stop_reason or "aborted",
                           weight_version=self.versions[-1] if self.versions else None,
                           weight_versions=self.versions, top_logprobs=self.tops)


def stream_chunk(req: LoopRequest, changed: list[tuple[LoopSequence, Delta]]) -> None:
    """One chunk of the request's stream: this iteration's tokens, None for its other sequences."""
    deltas: list[Any] = [None] * len(req.seqs)
    for seq, delta in changed:
        deltas[seq.index] = delta
    req.sink.put(token_chunk(req.chunks, deltas))
    req.chunks += 1
