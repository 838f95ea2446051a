"""`IterationLoop`: continuous batching of one replica, for plugins with the iteration protocol.

    submit(request) -> Entry.sequences -> [waiting: earliest deadline first, or fifo]
        every iteration: the plugin's admission policy admits waiting sequences (Entry.admission;
        default TokenBudget: max_num_seqs, max_num_batched_tokens), ONE plan (admit, drop,
        recompute) to every rank, one forward, the output rank's deltas (its KV report to KVBlocks)
        -> each sequence's tokens (log-probs, per-token weight versions) or value -> the request
           resolves when its last sequence ends (Entry.gather), its stream gets one chunk per iteration

A sequence joins at the next iteration and leaves the one it ends in, so a short request admitted
beside a long one finishes first. Sequences are admitted (with a `Turns` policy: take turns) earliest deadline
first (own, else arrival + `default_deadline_s` + its steps x the pace: turns.py) or in arrival order ("fifo");
a request with no slot by its own deadline is answered with DeadlineMissedError and never runs. Finish-by: at
submit and at the head, a request with its own deadline stays only if its planned iterations
(`SequenceSpec.steps`; a stream: 1, its first chunk) x the recent pace end before it; else it is
answered at once (sequences.py). The pace: an iteration's run plus the loop's work until the next
(iterations that advanced no sequence, `Deltas.stepped` False, are left out of it).
Requests keep the engine's contract: a future per request (`cancel()` drops its sequences at the
next iteration and frees their slots, whenever it is called), `RequestTimeoutError` past its own
limit (limits.py; dropped likewise), exact counts (`queued`: no sequence admitted yet;
`dispatched`: some running). Control at iteration boundaries: its `control` part (iteration_control.py).

A part of its replica, given its collaborators; it never runs plugin code on the ranks itself. Each
iteration goes onto the `pipeline` (`run_iteration(plan)`: the replica's `RankPipeline`, whose hang
clock, ordering and failure path apply to iterations as to steps; `record(size, waits)` feeds its
histograms); callbacks run on `delivery`; `on_failure(error)` stops the replica if the loop breaks.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Collection

from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.futures import EngineFuture
from phyai_ray.executors.failing import failed_all, failed_alone, reply_parts
from phyai_ray.executors.iteration_control import IterationControl
from phyai_ray.executors.limits import RequestLimits
from phyai_ray.executors.ledger import Counts, Tally, deadline_missed, enqueue, overloaded
from phyai_ray.executors.loop_timing import IterationTimes, quantiles_ms
from phyai_ray.executors.sequences import (GATHER, Deadlines, LoopRequest, LoopSequence, fail_closed,
                                           finish_by_miss, first_chunk_missed, planned_steps, settle, stream_chunk)
from phyai_ray.executors.service import ServiceTime
from phyai_ray.executors.turns import admission_of
from phyai_ray.outputs import merge_stream_chunks
from phyai_ray.plugins.iteration import AdmissionPolicy, Delta, IterationPlan, RankIteration, capacity_of, stepped
from phyai_ray.streams import ChunkSink, LocalReader

logger = logging.getLogger(__name__)

_TICK_S = 1.0  # an idle loop re-reads deadlines at least this often
_REPLY_GRACE_S = 30.0  # past the hang limit the pipeline's hang clock fails the replica first
_IDLE_EXIT_S = 5.0  # the loop's thread ends after this long with nothing to do (started again on submit)
_COMPACT_SLACK = 64  # left sequences `_waiting` may hold beyond twice the waiting ones


class IterationLoop:
    """Waiting and running sequences of one replica, and the thread that iterates them (a request
    queue of the replica: see queues.py) onto its `pipeline`."""

    iterative = True

    def __init__(self, index: int, entry: Any, batching: Any, *, pipeline: Any, delivery: Any,
                 on_failure: Callable[[BaseException], None], limit_s: float, max_queued: int | None,
                 cap_s: float | None = None) -> None:
        self.index, self._entry = index, entry
        self._pipeline, self._delivery, self._on_failure = pipeline, delivery, on_failure
        self.policy = entry.admission(batching)
        if not isinstance(self.policy, AdmissionPolicy):
            raise TypeError(f"plugin {entry.display_name()}: admission(batching) must return a policy with "
                            f"begin(running) and admit(candidate) (phyai_ray.plugins.admission), got {self.policy!r}")
        self.edf = batching.scheduling == "deadline"
        self.limit_s, self.max_queued = limit_s, max_queued  # limit_s: one iteration's hang limit
        self.limits = RequestLimits(cap_s, limit_s)  # each request's own limit (limits.py)
        self.horizon_s = batching.default_deadline_s or limit_s  # orders a request without its own deadline
        self.admission = admission_of(self.policy, self.horizon_s)  # in order, or turns (turns.py)
        self._report = getattr(self.policy, "report", None)  # a policy that reads the ranks' KV cache (KVBlocks)
        self._cond = threading.Condition()
        self.control = IterationControl(index, self._cond, self,
                                        recompute_after_update=batching.cache_after_update == "recompute")
        self._waiting: deque[LoopSequence] = deque()  # in admission order (ledger.enqueue); left ones stay "done"
        self._n_waiting = 0  # sequences in `_waiting` still waiting
        self._running: dict[int, LoopSequence] = {}
        self._to_drop: list[int] = []
        self._requests: dict[LoopRequest, None] = {}  # in submission order, so in the order they expire
        self._deadlines = Deadlines()  # the requests' own deadlines
        self._queued = 0  # requests none of whose sequences was admitted yet
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self.tally = Tally()
        self.iterations = 0
        self._durations: deque[float] = deque(maxlen=2048)  # seconds of the latest iterations, plan to deltas
        self.service, self._last_end, self.times = ServiceTime(), None, IterationTimes()  # pace; loop_timing.py
        logger.info("replica %d: continuous batching, admission %r", index, self.policy)

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request: Any, sink: ChunkSink | None = None, *, key: Any = None, size: int = 1,
               deadline: float | None = None, late: str = "finish") -> EngineFuture:
        """Queue the request's sequences; the future resolves to `Entry.gather(request, outputs)`.
        `deadline`: its own (monotonic), by which a sequence must have a slot (a stream: its first
        chunk) and its estimate must end; `late="drop"`: by which it must end (else dropped, missed)."""
        sequences = list(self._entry.sequences(request))
        if not sequences:
            raise ValueError(f"plugin {self._entry.display_name()}: sequences(request) returned no sequence")
        future = EngineFuture(self._delivery, self._cancelled)
        future.replica, future.deadline = self.index, deadline
        req = LoopRequest(request, future, self.limits.cap_s or self.limit_s, sink, deadline)
        req.late, req.until = late, "end" if late == "drop" else "chunk" if sink is not None else "slot"
        if deadline is None:  # due `horizon_s` after arrival, pushed back by its own work (turns.priority)
            steps = planned_steps(sequences, self._entry.display_name()) or 0  # (it is never failed for it)
            req.order = req.submitted + self.horizon_s + steps * self.service.estimate()
        future.work = req
        if deadline is not None and self.control.refusal is None:  # finish-by: a hopeless request never waits
            req.steps = 1 if req.until == "chunk" else planned_steps(sequences, self._entry.display_name())
            missed = finish_by_miss(self.index, req, time.monotonic(), self.service.estimate())
            if missed is not None:
                self.settle([(req, None, missed)])
                return future
        with self._cond:
            if self.control.refusal is not None:
                raise self.control.refusal()
            queued = self._queued
            if self.max_queued is not None and queued >= self.max_queued:
                raise overloaded(self.index, queued, self.max_queued, f"{len(self._running)} running sequence(s) "
                                 f"(admission {self.policy!r}) for a sequence slot")
            req.seqs = [LoopSequence(next(self._ids), req, i, s.payload, max(int(s.cost), 1), getattr(s, "group", None),
                                     getattr(s, "steps", None)) for i, s in enumerate(sequences)]
            req.left = len(req.seqs)
            self.limits.open(req, planned_steps(sequences, self._entry.display_name()))
            self._requests[req] = None
            self._queued += 1
            for seq in req.seqs:
                enqueue(self._waiting, seq, self.edf)
            if deadline is not None:
                self._deadlines.push(req)
            self._n_waiting += len(req.seqs)
            self.wake()
        return future

    def submit_stream(self, request: Any, max_buffered: int, deadline: float | None = None
                      ) -> tuple[EngineFuture, LocalReader]:
        """A streamed request: one chunk per iteration that gave any of its sequences a token,
        {"index": k, "token_ids": [id or None per sequence], "log_probs": [...]}; its first chunk by
        `deadline` (monotonic), else DeadlineMissedError. Past `max_buffered` unread chunks the next fold
        into the last (a sequence's entry becomes its token list): a slow reader holds up no one."""
        sink = ChunkSink(max_buffered=max_buffered, merge=merge_stream_chunks)
        future = self.submit(request, sink, deadline=deadline)
        return future, LocalReader(sink, future)

    def counts(self) -> Counts:
        with self._cond:
            return Counts(self._queued, len(self._requests) - self._queued, self.tally.served, self.tally.errored)

    def has_room(self) -> bool:
        with self._cond:
            return self.control.refusal is None and (self.max_queued is None or self._queued < self.max_queued)

    def snapshot(self) -> dict[str, Any]:
        with self._cond:  # counts and a copy here; sorting outside, so a scrape never holds up the loop
            out = {"running_sequences": len(self._running), "waiting_sequences": self._n_waiting,
                   "iterations": self.iterations, "iteration_ms": list(self._durations)}
        return {**out, "iteration_ms": quantiles_ms(out["iteration_ms"]), **self.times.snapshot()}

    def durations(self, last: int) -> list[float]:
        """Seconds of each of the latest `last` iterations (plan sent to deltas back), oldest first."""
        with self._cond:
            return list(self._durations)[-last:] if last > 0 else []

    def _cancelled(self, future: EngineFuture) -> None:
        """The caller cancelled: its sequences leave at the next iteration (a running one frees its slot)."""
        with self._cond:
            req = future.work
            if req in self._requests:
                self.forget(req)
                self.wake()

    def forget(self, req: LoopRequest) -> None:
        """Lock held: remove the request's sequences; running ones are dropped at the ranks next iteration."""
        if self._requests.pop(req, 0) is None and not req.admitted:
            self._queued -= 1
        self._deadlines.discard(req)
        for seq in req.seqs:
            if seq.state == "running":
                del self._running[seq.ident]
                self._to_drop.append(seq.ident)
            elif seq.state == "waiting":
                self._n_waiting -= 1  # it stays in `_waiting` until the planner passes it...
            seq.state = "done"
        if len(self._waiting) > 2 * self._n_waiting + _COMPACT_SLACK:  # ...or until the left ones outnumber
            self._waiting = deque(s for s in self._waiting if s.state == "waiting")  # it (held: no planner)

    def wake(self) -> None:
        """Lock held: make the loop's thread look again (start it if it ended)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"phyai-iterations-{self.index}", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # a bug here must not leave futures without an outcome (or a clock)
            logger.exception("replica %d: the iteration loop failed", self.index)
            with self._cond:
                self._thread = None
            self._on_failure(EngineUnavailableError(
                f"replica {self.index}: its iteration loop failed ({type(exc).__name__}: {exc}); the replica was "
                "stopped and the requests it held were failed", reason="exception", replica=self.index))

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            settle: list[tuple[LoopRequest, Any, BaseException | None]] = []
            with self._cond:
                if self.control.refusal is not None:
                    self._thread = None
                    return
                now = time.monotonic()
                settle += self._expire(now)
                plan = self._plan(settle) if self._can_iterate() else None
                if plan is not None and plan[0].empty and not self._running:
                    plan = None  # every waiting head was refused by its deadline: nothing to run
                if plan is None and not settle:
                    if not self._requests and not self._to_drop and now - idle_since >= _IDLE_EXIT_S:
                        self._thread = None
                        return
                    self._cond.wait(timeout=max(min(self._next_wake() - now, _TICK_S), 0.001))
                    continue
                if plan is not None:
                    self.control.in_flight = True
            self.settle(settle)
            if plan is not None:
                self._iterate(plan, time.monotonic() - now)
                idle_since = time.monotonic()

    def _can_iterate(self) -> bool:
        control = self.control
        return not control.held and bool(self._running or self._to_drop or (self._n_waiting and control.admitting))

    def _plan(self, settle: list) -> tuple[IterationPlan, list[LoopSequence], list[LoopSequence]]:
        """Lock held: this iteration's drops, rebuilds, admissions and turns (refused requests go to `settle`)."""
        drop, self._to_drop = tuple(self._to_drop), []
        rebuild = [s for s in self._running.values() if s.stale]
        head = (lambda key: self._head(settle, key)) if self._n_waiting and self.control.admitting else None
        admitted, pause, resume = self.admission.plan(self._running.values(), rebuild, self.service.estimate(), head,
                                                      self._join)
        for seq in admitted:
            seq.request.future.batch_size = len(self._running)
        plan = IterationPlan(admit=tuple((s.ident, s.payload) for s in admitted), drop=drop,
                             recompute=tuple(s.ident for s in rebuild), pause=pause, resume=resume)
        return plan, admitted, rebuild

    def _head(self, settle: list, key: Callable | None) -> LoopSequence | None:
        """Lock held: the waiting head (left ones popped); one that can no longer meet its own deadline
        (finish-by, see the module docstring; turns: behind those ahead by `key`) leaves, in `settle`."""
        while self._waiting:
            seq = self._waiting[0]
            if seq.state != "waiting":  # its request left (cancelled, expired, aborted)
                self._waiting.popleft()
                continue
            if seq.request.deadline is not None and not seq.request.admitted:
                turns = self.admission.iterations(seq, self._running.values(), key)
                missed = finish_by_miss(self.index, seq.request, time.monotonic(), self.service.estimate(), turns)
                if missed is not None:
                    self.forget(seq.request)  # its sequences are "done" now: the next turns pop them
                    settle.append((seq.request, None, missed))
                    continue
            return seq
        return None

    def _join(self, seq: LoopSequence) -> None:
        """Lock held: the waiting head `seq` gets a slot (it runs from this iteration on)."""
        self._waiting.popleft()
        self._n_waiting -= 1
        seq.state, self._running[seq.ident] = "running", seq
        if not seq.request.admitted:
            seq.request.admitted = True
            self._queued -= 1
            if seq.request.until == "slot":  # its own deadline asked for a slot: it has one
                self._deadlines.discard(seq.request)
            seq.request.future.started = time.monotonic()

    def _iterate(self, formed: tuple[IterationPlan, list[LoopSequence], list[LoopSequence]], planning_s: float) -> None:
        plan, admitted, rebuild = formed
        now = time.monotonic()
        try:
            future = self._pipeline.run_iteration(plan)
            reply = future.result(timeout=self.limit_s + _REPLY_GRACE_S)
            error = None
        except BaseException as exc:  # the replica failed (its error), or the plugin raised (inline)
            reply, error, future = None, exc, None
        settle: list[tuple[LoopRequest, Any, BaseException | None]] = []
        with self._cond:
            self.control.in_flight, self.iterations, end = False, self.iterations + 1, time.monotonic()
            prev, self._last_end = self._last_end, end
            self._durations.append(end - now)
            if stepped(reply):  # the pace: back to back, the run + the loop's own work; else the run
                self.service.record(end - prev if prev is not None and now - prev < end - now else end - now)
            if error is not None:
                settle = failed_all(self.index, self._running, self.forget, error)  # every running request
            else:
                version = getattr(future, "weight_version", None)
                for seq in (*admitted, *rebuild):
                    seq.cache_version, seq.stale = version, False
                size = len(self._running)
                settle = self._apply(reply, version)
                if self._report is not None and (capacity := capacity_of(reply)) is not None:
                    self._report(capacity)  # the output rank's KV cache now, before the next plan
                self._pipeline.record(size, [now - s.request.submitted for s in admitted])
            self._cond.notify_all()
        self.settle(settle)
        self.times.record(planning_s + time.monotonic() - end, end - now, getattr(reply, "timing", None))

    def _apply(self, reply: RankIteration | dict[int, Delta] | None, version: Any) -> list:
        """Lock held: fail the sequences that failed alone (failing.py), add every other sequence's new
        tokens or value; the requests that ended or failed, to settle."""
        deltas, errors = reply_parts(reply)
        failed, ended, touched = failed_alone(self._running, self._requests, self.forget, errors), [], {}
        for ident, delta in deltas.items():
            seq = self._running.get(ident)
            if seq is None:  # cancelled or expired after the plan left: its drop is on its way
                continue
            seq.add(delta, version)
            if seq.request.sink is not None and (delta.token_ids or delta.progress is not None):
                touched.setdefault(id(seq.request), (seq.request, []))[1].append((seq, delta))
            if delta.stop_reason is not None:
                seq.stop_reason, seq.state = delta.stop_reason, "done"
                del self._running[ident]
                seq.request.left -= 1
                if seq.request.left == 0 and seq.request in self._requests:
                    del self._requests[seq.request]
                    self._deadlines.discard(seq.request)
                    ended.append(seq.request)
        for req, changed in touched.values():
            if req.until == "chunk":  # its own deadline asked for a first chunk: it has one now
                self._deadlines.discard(req)
            stream_chunk(req, changed)
        return failed + [self._ended(req) for req in ended]

    def _ended(self, req: LoopRequest) -> tuple:
        """A request whose sequences all ended: its gathered result, or the missed error (fail closed)."""
        return (req, *fail_closed(self.index, req, GATHER, None))

    def _expire(self, now: float) -> list:
        """Lock held: requests past `expires` leave (running sequences are dropped next iteration);
        requests past their own deadline and still owing what it asks for are answered missed."""
        missed = []
        for req in self._deadlines.due(now):  # only requests still owing what their deadline asks for
            if req in self._requests:
                self.forget(req)  # a running one (late="drop", a stream): its sequences leave next iteration
                error = first_chunk_missed(self.index, req, now) if req.admitted and req.until == "chunk" else \
                    deadline_missed(self.index, now - req.submitted, req.deadline - req.submitted,
                                    late_result=req.admitted)
                missed.append((req, None, error))
        for req, error in self.limits.due(self._requests, now, self.service.estimate(), self.index):
            self.forget(req)  # past its cap or its estimate (limits.py): its sequences leave next iteration
            missed.append((req, None, error))
        return missed

    def _next_wake(self) -> float:
        """When the next request expires or reaches its own deadline (monotonic)."""
        return min(next((r.expires for r in self._requests), float("inf")), self._deadlines.next())

    # -- what its control part asks (iteration_control.LoopBooks) -----------------------------
    def settle(self, items: list) -> None:
        """Resolve (request, value, error) items outside the lock (sequences.settle)."""
        settle(self.index, self._entry, self.tally, items)

    def requests(self) -> list[LoopRequest]:
        return list(self._requests)

    def running_sequences(self) -> Collection[LoopSequence]:
        return self._running.values()

    def has_work(self) -> bool:
        return bool(self._requests or self._to_drop)

    def clear(self) -> list[LoopRequest]:
        """Lock held: empty the books (the replica stopped); the requests they held."""
        left = list(self._requests)
        self._requests.clear()
        self._queued = self._n_waiting = 0
        self._waiting.clear()
        self._running.clear()
        self._deadlines.clear()
        return left

    def quiesce(self, op: str, mode: str, deadline: float) -> int:
        return self.control.quiesce(op, mode, deadline)

    def release(self, version: Any) -> None:
        self.control.release(version)

    def stop(self, refusal: Callable[[], BaseException], *, cancel_waiting: bool = False) -> None:
        self.control.stop(refusal, cancel_waiting=cancel_waiting)
