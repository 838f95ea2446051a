"""A replica's request queue: where its requests wait, and how they are batched, until they reach its ranks.

One per replica, chosen once when the replica is built (`Replica`, base.py):

    StepQueue      requests as steps, or batches of steps, dispatched onto the rank pipeline
    IterationLoop  requests as sequences of the continuous-batching loop (iterations.py)

Both answer the same calls (`RequestQueue`), so nothing else asks which one a replica has. Beneath
both, `RankPipeline` (pipeline.py) holds what is at the ranks: in-order dispatch, the hang clock,
collective_rpc ordering, holding for control calls. Both settle through the same ledger (ledger.py).

    submit -> [queued ....... max_queued_requests] --feed()--> RankPipeline [max_ongoing] -> ranks
                  cancellable, dropped at deadline

* A full queue refuses at once with `EngineOverloadedError` (nothing queued); the dispatcher then
  tries another replica.
* Order: `edf` (BatchingConfig.scheduling "deadline", the default) keeps the queue in earliest-
  deadline-first order (a request's own `deadline`, else its `due`, else when it expires); else
  arrival order. A request whose own deadline passes before it is dispatched, or comes before now
  plus the recent step time (finish-by admission), is answered DeadlineMissedError, unrun; one past
  `submitted + limit` fails with `RequestTimeoutError` and never reaches a rank.
* `cancel()` of a queued request's future returns True and nothing reaches a rank; once dispatched
  it returns False.
* Batching (`policy`, set by the replica when the plugin has `step_batch` and batching is on): each
  dispatch takes a batch of compatible queued requests (`batching.form_batch`) and sends it as ONE
  "batch" work; each member keeps its own future, deadline and accounting. A head may wait for a
  fuller batch until `wait_until`; the replica's `DeadlineClock` (clock.py) wakes the queue then.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Protocol

from phyai_ray.errors import RequestAbortedError
from phyai_ray.executors.batching import BatchPolicy, form_batch
from phyai_ray.executors.clock import DeadlineClock
from phyai_ray.executors.futures import EngineFuture
from phyai_ray.executors.ledger import Counts, enqueue, missed_error, overloaded, timeout_error
from phyai_ray.executors.pipeline import RankPipeline
from phyai_ray.work import STEP, STREAM, Work


class RequestQueue(Protocol):
    """Where one replica's requests wait until they reach its ranks."""

    iterative: bool

    def submit(self, request: Any, *, key: Any = None, size: int = 1, deadline: float | None = None,
               late: str = "finish") -> Any: ...

    def submit_stream(self, request: Any, max_buffered: int, deadline: float | None = None) -> tuple[Any, Any]:
        """`deadline`: the first chunk's (monotonic); the iteration loop admits and drops by it, a
        StepQueue leaves it to the stream's reader (Engine.read_stream, async_streams.stream_items)."""

    def counts(self) -> Counts:
        """The requests it holds (the pipeline counts those at the ranks)."""

    def has_room(self) -> bool: ...

    def snapshot(self) -> dict[str, Any]: ...

    def quiesce(self, op: str, mode: str, deadline: float) -> int:
        """Stop as control call `op` needs; how many requests pause(mode="abort") ended."""

    def release(self, version: Any) -> None: ...

    def stop(self, refusal: Callable[[], BaseException], *, cancel_waiting: bool = False) -> None: ...


class StepQueue:
    """Requests of a plugin without the iteration protocol, waiting to go onto `pipeline` as steps
    (or batch members). `executor` serializes a request once, here, before it takes a slot."""

    iterative = False

    def __init__(self, index: int, pipeline: RankPipeline, executor: Any, *, lock: threading.RLock,
                 clock: DeadlineClock, limit_s: float, max_queued: int | None) -> None:
        self.index, self.max_queued, self._limit_s = index, max_queued, limit_s
        self._pipeline, self._executor, self._lock, self._clock = pipeline, executor, lock, clock
        self._queued: deque[Work] = deque()
        self._refusal: Callable[[], BaseException] | None = None
        self._flush_at = float("inf")  # a batch head waits for more requests until then
        self.policy: BatchPolicy | None = None  # batching on: every dispatch takes a batch
        self.edf = True  # earliest deadline first (BatchingConfig.scheduling "deadline"); False: arrival order
        self.default_deadline_s: float | None = None  # BatchingConfig.default_deadline_s: orders no-deadline requests
        pipeline.feed_from(self)
        clock.watch(self._next_deadline, self.expire)

    # -- requests -------------------------------------------------------------------------------
    def submit(self, request: Any, *, key: Any = None, size: int = 1, deadline: float | None = None,
               late: str = "finish") -> EngineFuture:
        payload = self._executor.prepare(request)
        return self.put(STEP, payload, self._limit_s, key=key, size=size, weight=self._executor.weight(payload),
                        deadline=deadline, late=late)

    def submit_stream(self, request: Any, max_buffered: int, deadline: float | None = None) -> tuple[Any, Any]:
        payload, reader_for = self._executor.stream(request, max_buffered)
        future = self.put(STREAM, payload, self._limit_s)
        return future, reader_for(future)

    def put(self, kind: str, payload: Any, limit_s: float, *, here: bool = False, key: Any = None, size: int = 1,
            weight: int = 0, deadline: float | None = None, late: str = "finish") -> EngineFuture:
        """Queue a prepared request; its future.

        `here=True`: when nothing is queued, at the ranks or holding them, the request is dispatched
        without `launch` and `future.work.here` is set: the caller must run it now. `deadline`: the
        request's own (monotonic); one that falls before now plus the recent step time is answered
        DeadlineMissedError at once (finish-by admission). `late="drop"`: a result ready after
        `deadline` is answered as missed."""
        pipeline = self._pipeline
        future = EngineFuture(pipeline.delivery, self._cancelled)
        work = Work(kind, payload, limit_s, future)
        work.key, work.size, work.weight, work.deadline, work.late = key, size, weight, deadline, late
        if deadline is None and self.default_deadline_s is not None:
            work.due = work.submitted + self.default_deadline_s
        future.work, future.replica, future.deadline = work, self.index, deadline
        if deadline is not None and work.missed(work.submitted, pipeline.service.estimate()):
            pipeline.deliver(work, error=missed_error(self.index, work, work.submitted, pipeline.service.estimate()))
            return future
        with self._lock:
            refusal = self._refusal or pipeline.stopped
            if refusal is not None:
                raise refusal()
            if here and not self._queued and pipeline.idle() and self._quiet():
                future.start()
                work.here = self.policy is None  # batching on: the worker thread runs it (see _quiet)
                pipeline.dispatch(work)
            else:
                if self.max_queued is not None and len(self._queued) >= self.max_queued and not self._free_now():
                    raise overloaded(self.index, len(self._queued), self.max_queued, pipeline.describe())
                enqueue(self._queued, work, self.edf)
                self.feed()
            expires = work.submitted + limit_s  # work.expires
            self._clock.arm(expires if deadline is None or deadline > expires else deadline)
        pipeline.send_launches()
        return future

    def _quiet(self) -> bool:
        """Lock held: with batching on, the caller's thread runs a request alone only when the replica
        has been idle for `BatchPolicy.idle_gap_s`: right after a step, more requests are on their way
        (the clients it answered send their next ones), and one run alone would cost a whole step.
        With batching on, a quiet replica dispatches the request at once (no batch delay) but its
        worker thread runs it, never the caller's: a plugin that runs on two threads keeps two
        intra-op (OpenMP) pools that spin against each other (sequential `step()` calls with the
        defaults took 27 ms each that way, 4.3 ms handed off; reference_dit on 2 cores)."""
        return self.policy is None or time.monotonic() - self._pipeline.last_finish >= self.policy.idle_gap_s

    def _free_now(self) -> bool:
        """A request submitted now would go straight to the ranks."""
        return self._pipeline.has_slot() and not self._pipeline.held and not self._queued

    def _cancelled(self, future: EngineFuture) -> None:
        """A queued future was cancelled by its caller: it leaves the queue, nothing reaches a rank."""
        with self._lock:
            try:
                self._queued.remove(future.work)
            except ValueError:
                pass

    # -- feeding the pipeline (lock held) ---------------------------------------------------------
    def waiting(self) -> bool:
        return bool(self._queued)

    def feed(self) -> None:
        """Move queued requests onto the pipeline while it has a free slot."""
        pipeline = self._pipeline
        while self._queued and pipeline.has_slot() and self._refusal is None and pipeline.stopped is None \
                and not pipeline.held:
            if self.policy is not None:
                if not self._feed_batch():
                    return
                continue
            work = self._queued.popleft()
            now = time.monotonic()
            if work.missed(now, pipeline.service.estimate()):
                pipeline.deliver(work, error=missed_error(self.index, work, now, pipeline.service.estimate()))
            elif work.future.start():  # False: cancelled while queued
                pipeline.dispatch(work)

    def _feed_batch(self) -> bool:
        """Dispatch the next batch; False when the head waits for a fuller one (the clock wakes it)."""
        pipeline = self._pipeline
        now, service_s = time.monotonic(), pipeline.service.estimate()
        head = self._queued[0]
        if head.kind != STEP:  # a stream runs alone: its payload is (request, sink), never a batch member
            self._queued.popleft()
            if head.expires <= now or head.missed(now, service_s):
                pipeline.deliver(head, error=self._dead_error(head, now, service_s))
            elif head.future.start():
                pipeline.dispatch(head)
            return True
        formed = form_batch(self._queued, self.policy, now,
                            lambda w: not w.future.done() and w.expires > now and not w.missed(now, service_s),
                            service_s)
        for work in formed.dead:  # never dispatched: expired ones fail, cancelled ones are already done
            pipeline.deliver(work, error=self._dead_error(work, now, service_s))
        if formed.wait_until is not None:
            self._flush_at = formed.wait_until
            self._clock.arm(formed.wait_until)
            return False
        members = [w for w in formed.batch if w.future.start()]  # False: cancelled this instant
        if members:
            pipeline.dispatch(Work.batch(members))
        return True

    def _dead_error(self, work: Work, now: float, service_s: float) -> BaseException:
        if work.missed(now, service_s):
            return missed_error(self.index, work, now, service_s)
        return timeout_error(self.index, work, now)

    # -- the clock --------------------------------------------------------------------------------
    def _next_deadline(self) -> float:
        """Lock held: when a waiting batch head is flushed, or a queued request expires or misses."""
        times = [w.expires if w.deadline is None else min(w.expires, w.deadline) for w in self._queued]
        return min(self._flush_at, min(times, default=float("inf")))

    def expire(self, now: float) -> None:
        """Flush a batch head whose delay is over; fail queued requests past their time (never run)."""
        with self._lock:
            if self._refusal is not None:
                return
            if self._flush_at <= time.monotonic():
                self._flush_at = float("inf")
                self.feed()
        self._pipeline.send_launches()
        with self._lock:
            if self._refusal is not None:
                return
            expired = [w for w in self._queued if w.expires <= now or w.missed(now)]
            if expired:
                self._queued = deque(w for w in self._queued if w.expires > now and not w.missed(now))
        for work in expired:
            self._pipeline.deliver(work, error=missed_error(self.index, work, now, 0.0) if work.missed(now)
                                   else timeout_error(self.index, work, now))

    # -- what routing and status read; control ----------------------------------------------------
    def counts(self) -> Counts:
        with self._lock:
            return Counts(len(self._queued), 0, 0, 0)

    def has_room(self) -> bool:
        """Whether a request submitted now would be admitted."""
        with self._lock:
            return self._refusal is None and self._pipeline.stopped is None and (
                self.max_queued is None or len(self._queued) < self.max_queued or self._free_now())

    def snapshot(self) -> dict[str, Any]:
        return {}

    def quiesce(self, op: str, mode: str, deadline: float) -> int:
        """Hold the pipeline; pause(mode="abort") also fails every queued request (how many)."""
        self._pipeline.hold()
        if not (op == "pause" and mode == "abort"):
            return 0
        with self._lock:
            queued, self._queued = list(self._queued), deque()
        for work in queued:
            self._pipeline.deliver(work, error=_aborted(self.index))
        return len(queued)

    def release(self, version: Any) -> None:
        pass  # the pipeline's release feeds it

    def stop(self, refusal: Callable[[], BaseException], *, cancel_waiting: bool = False) -> None:
        """Refuse new requests; cancel (`cancel_waiting`) or fail every queued one."""
        with self._lock:
            self._refusal = refusal
            queued, self._queued = list(self._queued), deque()
        for work in queued:
            if not (cancel_waiting and work.future.cancel()):
                self._pipeline.deliver(work, error=refusal())


def _aborted(index: int) -> RequestAbortedError:
    return RequestAbortedError(f"replica {index} was paused with mode='abort'; the request was dropped before it "
                               "reached a rank: submit it again after resume()", replica=index)
