"""What the iteration loop keeps per request and per sequence.

    LoopRequest     a request: its future, its own deadline, when it expires, sequences left, stream sink
    LoopSequence    a sequence: payload, cost, group; its tokens (log-probs, per-token weight versions)
                    or its value so far, and the weight version of its latest output
    Candidates      the running sequences as an admission policy sees them, made only when read
    stream_chunk    one iteration's chunk of a streamed request: {"index", "token_ids", "log_probs"}, or a
                    value request's progress report
    Deadlines       the heap of the requests' own deadlines; a request leaves it when its deadline is
                    no longer owed (it got a slot, its first chunk, or it ended), so it stays small
    finish_by_miss  the DeadlineMissedError of a request whose estimate says it cannot meet its deadline
    settle          resolve ended requests outside the loop's lock: gather (GATHER), fail closed, close streams

What a request's own deadline asks for (`LoopRequest.until`) and the estimate admission checks
(`LoopRequest.steps` iterations x the loop's recent iteration time, from now):

    until="slot"    a whole request (late="finish"): steps = its longest sequence's `SequenceSpec.steps`
                    (a flow frame's denoising steps; an LLM's max_tokens, an upper bound: a sequence
                    that stops early would have made it, so give max_tokens you need); unknown: none
    until="end"     late="drop": the same estimate, and it must also end by the deadline
    until="chunk"   a stream: its first chunk by the deadline, so steps = 1 (the first iteration gives
                    an LLM's first token, a flow frame's first progress report)
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator, Sequence
from typing import Any

from phyai_ray.errors import DeadlineMissedError
from phyai_ray.executors.ledger import Tally, deadline_missed
from phyai_ray.executors.futures import EngineFuture
from phyai_ray.outputs import TokenOutput, token_chunk, version_order
from phyai_ray.plugins.iteration import Candidate, Delta
from phyai_ray.streams import ChunkSink

GATHER = object()  # a settled request whose result is still to be gathered (outside the lock)
_HEAP_SLACK = 64  # left entries the deadline heap may hold beyond its live ones
_candidate = tuple.__new__  # Candidate(*fields) without the keyword handling: the loop makes one per running
#                             sequence per plan while a sequence waits (0.2 us instead of 0.6 us each)


class LoopRequest:
    """One request of the loop: its future, its sequences, its deadlines and its stream (if any).

    `deadline`: its own deadline (monotonic; None: none), by which one of its sequences must have a
    slot, else it is answered DeadlineMissedError. `late="drop"`: it must also end by then, else its
    sequences are dropped at the next iteration and it is answered DeadlineMissedError (a flow frame
    late mid-way frees its slot). `expires`: submission + execution_timeout_s, when it fails with
    RequestTimeoutError wherever it is. `until` and `steps`: see the module docstring."""

    __slots__ = ("payload", "future", "seqs", "expires", "submitted", "sink", "left", "admitted", "chunks",
                 "deadline", "order", "heap_entry", "late", "until", "steps")

    def __init__(self, payload: Any, future: EngineFuture, limit_s: float, sink: ChunkSink | None,
                 deadline: float | None = None) -> None:
        self.payload, self.future, self.sink = payload, future, sink
        self.submitted = time.monotonic()
        self.expires = self.submitted + limit_s
        self.deadline = deadline
        self.order = deadline if deadline is not None else self.expires  # earliest-deadline-first key
        self.seqs: list[LoopSequence] = []
        self.left = 0  # sequences not ended yet
        self.admitted = False  # some sequence reached the ranks
        self.chunks = 0
        self.heap_entry: list | None = None  # its entry in `Deadlines` while it waits there
        self.late = "finish"  # "drop": it leaves the loop when its deadline passes, even while running
        self.until = "slot"  # what its deadline asks for: "slot", "chunk" (a stream) or "end" (late="drop")
        self.steps: int | None = None  # iterations the finish-by estimate counts (None: no estimate)


class LoopSequence:
    """One sequence: what its rank admits, what it costs, and its output so far (tokens or a value)."""

    __slots__ = ("ident", "request", "index", "payload", "cost", "group", "tokens", "log_probs", "versions",
                 "stop_reason", "cache_version", "stale", "state", "tops", "value", "version", "preempted",
                 "steps", "taken", "paused")

    def __init__(self, ident: int, request: LoopRequest, index: int, payload: Any, cost: int,
                 group: Any = None, steps: int | None = None) -> None:
        self.ident, self.request, self.index, self.payload = ident, request, index, payload
        self.cost, self.group = cost, group
        self.steps = steps  # its `SequenceSpec.steps` (None: unknown)
        self.taken = 0  # iterations it stepped in (turns: a paused one sits out; a rebuild starts again)
        self.paused = False  # turns: it sits out on the ranks (IterationPlan.pause) until resumed
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.versions: list[Any] = []  # the weight version of each token
        self.tops: list[dict[int, float]] = []  # per token, when the sequence asked for alternatives
        self.stop_reason: str | None = None
        self.value: Any = None  # a value sequence's result (Delta.value)
        self.version: Any = None  # the weight version of the iteration that gave its latest token or value
        self.cache_version: Any = None
        self.stale = False  # its state must be rebuilt from its history at its next iteration (recompute)
        self.state = "waiting"  # -> "running" (it has a slot) -> "done" (ended, or its request left)
        self.preempted = 0  # times the ranks preempted it (freed its cache to recompute it later)

    @property
    def order(self) -> float:
        return self.request.order

    def candidate(self) -> Candidate:
        """What the admission policy sees of it."""
        return _candidate(Candidate, (self.cost, self.group, len(self.tokens), self.stale))

    def add(self, delta: Delta, version: Any) -> None:
        """Take one iteration's delta, produced under weight `version`."""
        if delta.token_ids:
            self.tokens += delta.token_ids
            self.log_probs += delta.log_probs
            if len(delta.token_ids) == 1:
                self.versions.append(version)
            else:
                self.versions += [version] * len(delta.token_ids)
            if delta.top_logprobs:
                self.tops += delta.top_logprobs
            self.version = version
        if delta.value is not None:
            self.value, self.version = delta.value, version
        self.preempted += delta.preempted

    def output(self) -> Any:
        """What `Entry.gather` receives for this sequence: its `Delta.value` if it gave one, else a TokenOutput."""
        if self.value is not None:
            return self.value
        return TokenOutput(self.tokens, self.log_probs, stop_reason=self.stop_reason or "aborted",
                           weight_version=self.versions[-1] if self.versions else None,
                           weight_versions=self.versions, top_logprobs=self.tops, num_preempted=self.preempted)


class Candidates(Sequence):
    """The running sequences as an admission policy sees them (`Candidate`s), made only when read:
    a policy that needs no more than `len(running)` reads nothing else."""

    __slots__ = ("_seqs",)

    def __init__(self, seqs: list[LoopSequence]) -> None:
        self._seqs = seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [s.candidate() for s in self._seqs[i]]
        return self._seqs[i].candidate()

    def __iter__(self) -> Iterator[Candidate]:
        return (_candidate(Candidate, (s.cost, s.group, len(s.tokens), s.stale)) for s in self._seqs)

    def rebuilding(self) -> bool:
        """Whether any of them rebuilds its state this iteration (`any(c.rebuild for c in self)`, no Candidate made)."""
        return any(s.stale for s in self._seqs)


def stream_chunk(req: LoopRequest, changed: list[tuple[LoopSequence, Delta]]) -> None:
    """One chunk of the request's stream: this iteration's tokens, None for its other sequences; for a
    value request (no tokens), its progress report (one sequence: the report itself)."""
    deltas: list[Any] = [None] * len(req.seqs)
    for seq, delta in changed:
        deltas[seq.index] = delta
    if any(d.token_ids for _, d in changed):
        req.sink.put(token_chunk(req.chunks, deltas))
    elif len(deltas) == 1:  # a value sequence's report, as the plugin gave it: {"step": i, "of": n}
        req.sink.put(deltas[0].progress)
    else:
        req.sink.put({"index": req.chunks, "progress": [d.progress if d is not None else None for d in deltas]})
    req.chunks += 1


class Deadlines:
    """The requests' own deadlines, earliest first. A request that ends before its deadline leaves
    at once (`discard`: its entry is emptied, so the heap holds no ended request); emptied entries
    are skipped when they reach the top, and the heap is rebuilt when they outnumber the live ones."""

    def __init__(self) -> None:
        self._heap: list[list] = []  # [deadline, tie-break, request or None]
        self._live = 0
        self._count = 0

    def push(self, req: LoopRequest) -> None:
        self._count += 1
        req.heap_entry = [req.deadline, self._count, req]
        heapq.heappush(self._heap, req.heap_entry)
        self._live += 1

    def discard(self, req: LoopRequest) -> None:
        entry, req.heap_entry = req.heap_entry, None
        if entry is None:
            return
        entry[2] = None
        self._live -= 1
        if len(self._heap) > 2 * self._live + _HEAP_SLACK:
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)

    def due(self, now: float) -> list[LoopRequest]:
        """Pop the requests whose deadline is at or before `now`."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            req = heapq.heappop(self._heap)[2]
            if req is not None:
                req.heap_entry = None
                self._live -= 1
                out.append(req)
        return out

    def next(self) -> float:
        while self._heap and self._heap[0][2] is None:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else float("inf")

    def clear(self) -> None:
        for entry in self._heap:
            if entry[2] is not None:
                entry[2].heap_entry = None
        self._heap, self._live = [], 0

    def __len__(self) -> int:
        return self._live


def planned_steps(specs: Sequence[Any], plugin: str) -> int | None:
    """The iterations a request's longest sequence runs at most (`SequenceSpec.steps`); None when
    any sequence does not say. A bad value is a ValueError naming the plugin."""
    most = 0
    for spec in specs:
        steps = getattr(spec, "steps", None)
        if steps is None:
            return None
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"plugin {plugin}: SequenceSpec.steps={steps!r} must be an int >= 1 (the iterations "
                             "the sequence runs at most, e.g. its denoising steps or max_tokens) or None")
        most = max(most, steps)
    return most


def finish_by_miss(index: int, req: LoopRequest, now: float, per_iteration_s: float,
                   iterations: int | None = None) -> DeadlineMissedError | None:
    """None while `req` can still meet its own deadline if it starts at `now`: its `steps` iterations
    (or `iterations`, when turns make it sit some out: see turns.py) of `per_iteration_s` each (the
    loop's recent median; 0.0 before the first) end before the deadline, or with no estimate (`steps`
    None) the deadline is still ahead. Else the error that answers it, naming the estimate and the
    deadline. Worked example: deadline 100 ms after submission, 8 denoising steps of 15 ms, 5 ms
    waited -> 5 + 120 > 100: missed, without running."""
    count = iterations if iterations is not None and req.steps is not None else req.steps
    need = per_iteration_s * count if count is not None else 0.0
    if now + need < req.deadline:
        return None
    waited, given = now - req.submitted, req.deadline - req.submitted
    what = "its first chunk" if req.until == "chunk" else "its result"
    estimate = (f"{what} needs {count} iteration(s) of about {per_iteration_s * 1e3:.1f} ms here lately "
                f"({need * 1e3:.1f} ms)" if need > 0 else "it had no time left")
    return DeadlineMissedError(
        f"replica {index}: the request's deadline ({given * 1e3:.1f} ms) could not be met: {waited * 1e3:.1f} ms "
        f"waited and {estimate}; it was not run. Give it a later deadline or fewer steps (max_tokens), or add "
        "replicas or lower the load", replica=index, waited_s=waited, deadline_s=given)


def first_chunk_missed(index: int, req: LoopRequest, now: float) -> DeadlineMissedError:
    """The answer to a stream that got a slot but no chunk by its own deadline (it is dropped)."""
    waited, given = now - req.submitted, req.deadline - req.submitted
    return DeadlineMissedError(
        f"replica {index}: the stream's deadline ({given * 1e3:.1f} ms) passed after {waited * 1e3:.1f} ms, before "
        "its first chunk; the stream was dropped. Give it a later deadline, or add replicas or lower the load",
        replica=index, waited_s=waited, deadline_s=given)


def fail_closed(index: int, req: LoopRequest, value: Any, error: BaseException | None) -> tuple:
    """late="drop": a result gathered past its deadline is replaced by the missed error, decided as
    it is delivered (a deadline that falls while `gather` runs is not met)."""
    now = time.monotonic()
    if error is None and req.late == "drop" and req.deadline is not None and req.deadline <= now:
        return None, deadline_missed(index, now - req.submitted, req.deadline - req.submitted, late_result=True)
    return value, error


def settle(index: int, entry: Any, tally: Tally, items: list) -> None:
    """Resolve futures and close streams, outside the loop's lock (callbacks go to the delivery thread);
    a GATHER value is the request's result, gathered here (`entry.gather` is plugin code)."""
    for req, value, error in items:
        if value is GATHER:
            try:
                value = entry.gather(req.payload, [s.output() for s in req.seqs])
            except Exception as exc:  # the plugin's gather failed: this request fails with it
                value, error = None, exc
            value, error = fail_closed(index, req, value, error)
        if value is not None:  # before the result: a waiter reads it as soon as it wakes
            req.future.weight_version = max((s.version for s in req.seqs if s.tokens or s.value is not None),
                                            default=None, key=version_order)
        tally.settle(req.future, value, error)
        if req.sink is not None:
            if value is not None and req.chunks and not any(s.tokens for s in req.seqs):
                req.sink.put_last(value)  # a value stream that reported progress ends with its result
            req.sink.close()
