"""`ReplicaScheduler`: the engine-side queue of one replica and its bounded dispatch.

    submit -> [queued ....... max_queued_requests] -> [dispatched .. max_ongoing_requests] -> ranks
                  cancellable, dropped at deadline        in rank order; the head is RUNNING

* Requests wait here, on the caller's side; at most `max_ongoing` are at the ranks at once (a short
  pipeline: the ranks always have the next request, and never hold thousands of calls). A full
  queue refuses at once with `EngineOverloadedError`; the dispatcher then tries another replica.
* `collective_rpc` calls and iterations skip the queue (`bypass_queue`): dispatched at once, they run on the
  ranks right after the requests already dispatched, in the same order on every rank.
* Order: `edf` (BatchingConfig.scheduling "deadline", the default) keeps the queue in earliest-
  deadline-first order (a request's own `deadline`, else when it expires); else arrival order. A
  request whose own `deadline` passes before it is dispatched fails with DeadlineMissedError, unrun.
* Two clocks (clock.py). A request expires at `submitted + limit`: past it the future fails with
  `RequestTimeoutError` (a queued request is dropped and never reaches a rank; a dispatched one still
  runs, because ranks that share collectives cannot skip it one-sidedly). The replica is judged
  hung only when the head of the dispatched line has been RUNNING for its limit; running counts from
  when its predecessor finished, or from its dispatch if later. Load alone never fails a replica.
* `cancel()` of a queued request's future returns True and nothing reaches a rank; once dispatched
  it returns False. Every exit path (result, error, cancel, deadline, overload, group failure,
  close) keeps `queued`, `dispatched`, `served` and `errored` exact.
* Batching (`policy`, set by the executor when the plugin has `step_batch` and batching is on):
  each dispatch takes a batch of compatible queued requests (`batching.form_batch`) and sends it
  as ONE "batch" work to every rank; each member keeps its own future, deadline and accounting,
  and the output rank's list of results is handed out member by member. A dispatch slot holds a
  whole batch, so with `max_ongoing` 2 the next batch forms while one runs.

Pure Python, no Ray: the executor supplies `launch(work)` (send to every rank: N actor calls, or a
copy of a large body, so it is called in dispatch order but outside the scheduler's lock, by one
thread at a time) and `on_hung(work, running_s)`. One timer thread per replica
wakes only for the earliest deadline (of any queued or dispatched request: limits may differ, so
the queue's head need not hold the earliest).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from phyai_ray.errors import EngineOverloadedError
from phyai_ray.executors.batching import BatchPolicy, BatchStats, form_batch
from phyai_ray.executors.clock import DeadlineClock
from phyai_ray.executors.ledger import Counts, Tally, deadline_missed, enqueue, overloaded
from phyai_ray.executors.service import ServiceTime
from phyai_ray.executors.futures import CallbackThread, EngineFuture
from phyai_ray.executors.here import HereRun
from phyai_ray.work import BATCH, CALL, REQUEST_KINDS, STEP, Work

logger = logging.getLogger(__name__)


class ReplicaScheduler(DeadlineClock, HereRun):
    """Queue, bounded dispatch, deadlines and accounting of one replica (thread-safe)."""

    def __init__(self, index: int, *, max_ongoing: int | None, max_queued: int | None,
                 launch: Callable[[Work], None], on_hung: Callable[[Work, float], None],
                 delivery: CallbackThread) -> None:
        self.index, self.max_ongoing, self.max_queued = index, max_ongoing, max_queued
        self._launch, self._on_hung, self.delivery = launch, on_hung, delivery
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # the clock thread waits on it (clock.py)
        self._idle = threading.Condition(self._lock)  # drain() waits on it: a finish must not wake the clock
        self._draining = 0  # threads in drain()
        self._queued: deque[Work] = deque()
        self._dispatched: deque[Work] = deque()
        self._to_launch: deque[Work] = deque()  # dispatched, not yet sent (see _send_launches)
        self._launching = threading.Lock()
        self._head_since = 0.0
        self._reported_hung: Work | None = None  # a head reported hung once is not reported (or waited for) again
        self.tally = Tally()
        self._refusal: Callable[[], BaseException] | None = None  # set once the replica stops
        self._timer: threading.Thread | None = None
        self._wake_at = float("inf")  # the earliest deadline the clock knows of
        self._wakes_by = float("inf")  # when the clock thread wakes anyway (it re-reads every deadline then)
        self._held = False  # paused, asleep or updating: requests queue but nothing is dispatched
        self.weight_version: Any = None  # stamped on every future at dispatch
        self.policy: BatchPolicy | None = None  # batching on: every dispatch takes a batch
        self.edf = True  # earliest deadline first (BatchingConfig.scheduling "deadline"); False: arrival order
        self._flush_at = float("inf")  # a batch head waits for more requests until then
        self._last_finish = float("-inf")  # when the ranks last finished a step
        self.stats = BatchStats()
        self.service = ServiceTime()  # recent step time: finish-by admission and the batch delay's cap
        self.default_deadline_s: float | None = None  # BatchingConfig.default_deadline_s: orders no-deadline requests

    # -- admission ------------------------------------------------------------------------------
    def submit(self, kind: str, payload: Any, limit_s: float, *, all_ranks: bool = False,
               bypass_queue: bool = False, here: bool = False, key: Any = None, size: int = 1,
               weight: int = 0, deadline: float | None = None, late: str = "finish") -> EngineFuture:
        """Queue a request, or with `bypass_queue` dispatch at once (a collective_rpc, an iteration:
        they run right after what is already at the ranks, in the same order on every rank); returns
        its future.

        `here=True`: when nothing is queued or dispatched, the request is dispatched without
        `launch` and `future.work.here` is set: the caller must run it now, then call `finished`.
        It counts as dispatched meanwhile, so the hang clock and the accounting see it as usual.
        `deadline`: the request's own deadline (monotonic); see the module docstring. A request whose
        deadline falls before now plus the recent step time is answered DeadlineMissedError at once
        (finish-by admission). `late="drop"`: a result ready after `deadline` is answered as missed.
        """
        future = EngineFuture(self.delivery, self._cancelled)
        work = Work(kind, payload, limit_s, future, all_ranks)
        work.key, work.size, work.weight, work.deadline, work.late = key, size, weight, deadline, late
        if deadline is None and self.default_deadline_s is not None:
            work.due = work.submitted + self.default_deadline_s
        future.work, future.replica, future.deadline = work, self.index, deadline
        if deadline is not None and not bypass_queue and work.missed(work.submitted, self.service.estimate()):
            self.deliver(work, error=self._missed_error(work, work.submitted))
            return future
        with self._lock:
            if self._refusal is not None:
                raise self._refusal()
            if bypass_queue:  # `here` too: work the caller runs itself when nothing is at the ranks
                future.start()
                work.here = here and not self._dispatched
                self._dispatch(work)
            elif here and not self._held and not self._queued and not self._dispatched and self._quiet():
                future.start()
                work.here = self.policy is None  # batching on: the worker thread runs it (see _quiet)
                self._dispatch(work)
            else:
                if self.max_queued is not None and len(self._queued) >= self.max_queued and not self._free_now():
                    raise self._overloaded()
                enqueue(self._queued, work, self.edf)
                self._pump()
            expires = work.submitted + limit_s  # work.expires
            self._arm(expires if deadline is None or deadline > expires else deadline)
        self._send_launches()
        return future

    def _quiet(self) -> bool:
        """Lock held: with batching on, the caller's thread runs a request alone only when the replica
        has been idle for `BatchPolicy.idle_gap_s`: right after a step, more requests are on their way
        (the clients it answered send their next ones), and one run alone would cost a whole step.
        With batching on, a quiet replica dispatches the request at once (no batch delay) but its
        worker thread runs it, never the caller's: a plugin that runs on two threads keeps two
        intra-op (OpenMP) pools that spin against each other (sequential `step()` calls with the
        defaults took 27 ms each that way, 4.3 ms handed off; reference_dit on 2 cores)."""
        return self.policy is None or time.monotonic() - self._last_finish >= self.policy.idle_gap_s

    def has_room(self) -> bool:
        """Whether a request submitted now would be admitted."""
        with self._lock:
            return self._refusal is None and (self.max_queued is None or len(self._queued) < self.max_queued
                                              or self._free_now())

    def counts(self) -> Counts:
        with self._lock:
            running = sum(1 for w in self._dispatched for r in w.requests() if not r.future.done())
            return Counts(len(self._queued), running, self.tally.served, self.tally.errored)

    def batch_snapshot(self) -> dict[str, Any]:
        """Histograms of samples per dispatched step and of each request's queue wait."""
        with self._lock:
            return self.stats.snapshot()

    def record(self, size: int, waits: list[float]) -> None:
        """One batch of `size` (an iteration's sequences) and the queue wait of each newcomer (histograms)."""
        with self._lock:
            self.stats.record(size, waits)

    def _free_now(self) -> bool:
        """A request submitted now would go straight to the ranks."""
        return self._has_slot() and not self._held and not self._queued

    def _has_slot(self) -> bool:
        return self.max_ongoing is None or len(self._dispatched) < self.max_ongoing

    def _overloaded(self) -> EngineOverloadedError:
        return overloaded(self.index, len(self._queued), self.max_queued,
                          f"{len(self._dispatched)} at the ranks (max_ongoing_requests={self.max_ongoing})")

    # -- dispatch -------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Move queued requests to the ranks while there is a free slot (lock held)."""
        while self._queued and self._has_slot() and self._refusal is None and not self._held:
            if self.policy is not None:
                if not self._pump_batch():
                    return
                continue
            work = self._queued.popleft()
            if work.missed(time.monotonic(), self.service.estimate()):
                self.deliver(work, error=self._missed_error(work, time.monotonic()))
            elif work.future.start():  # False: cancelled while queued
                self._dispatch(work)

    def _pump_batch(self) -> bool:
        """Dispatch the next batch; False when the head waits for a fuller one (the clock wakes it)."""
        now, service_s = time.monotonic(), self.service.estimate()
        head = self._queued[0]
        if head.kind != STEP:  # a stream runs alone: its payload is (request, sink), never a batch member
            self._queued.popleft()
            if head.expires <= now or head.missed(now, service_s):
                self.deliver(head, error=self._missed_error(head, now) if head.missed(now, service_s) else
                             self._timeout_error(head, now))
            elif head.future.start():
                self._dispatch(head)
            return True
        formed = form_batch(self._queued, self.policy, now,
                            lambda w: not w.future.done() and w.expires > now and not w.missed(now, service_s),
                            service_s)
        for work in formed.dead:  # never dispatched: expired ones fail, cancelled ones are already done
            self.deliver(work, error=self._missed_error(work, now) if work.missed(now, service_s) else
                         self._timeout_error(work, now))
        if formed.wait_until is not None:
            self._flush_at = formed.wait_until
            self._arm(formed.wait_until)
            return False
        members = [w for w in formed.batch if w.future.start()]  # False: cancelled this instant
        if members:
            self._dispatch(Work.batch(members))
        return True

    def _dispatch(self, work: Work) -> None:
        now = work.dispatched = time.monotonic()
        if work.kind == BATCH:
            for member in work.members:
                member.future.weight_version, member.dispatched = self.weight_version, now
                member.future.started, member.future.batch_size = now, work.size
            self.stats.record(work.size, [now - m.submitted for m in work.members])
        else:
            work.future.weight_version = self.weight_version
            work.future.started, work.future.batch_size = now, work.size
            if work.kind in REQUEST_KINDS:  # an iteration records its own sequences (IterationLoop)
                self.stats.record_one(work.size, now - work.submitted)
        self._dispatched.append(work)
        if len(self._dispatched) == 1:
            self._head_since = work.dispatched
            self._arm(work.dispatched + work.limit_s)
        if not work.here:
            self._to_launch.append(work)

    def _send_launches(self) -> None:
        """Send dispatched work to the ranks in dispatch order, outside the lock. One thread sends at a
        time; one that finds another sending leaves its work to it (the sender looks again after it
        lets go, so nothing is left behind)."""
        while self._to_launch:
            if not self._launching.acquire(blocking=False):
                return
            try:
                while self._to_launch:
                    work = self._to_launch.popleft()
                    if self._refusal is None:  # stopped meanwhile: stop() fails (or keeps) what it dispatched
                        self._launch(work)
            finally:
                self._launching.release()

    # -- completion -----------------------------------------------------------------------------
    def deliver(self, work: Work, value: Any = None, error: BaseException | None = None) -> None:
        """Resolve `work`'s future (it may still be running on other ranks); requests are counted once.

        A batch: `error` fails every member; else `value` is the output rank's list, one result per
        member in order, where an exception instance fails only its member."""
        if work.kind == BATCH:
            self._deliver_batch(work, value, error)
            return
        if work.future is None:  # settled and released by the thread that ran it (ScheduledReplica.submit)
            return
        if error is None and work.late == "drop" and work.missed(time.monotonic()):
            now = time.monotonic()
            error = deadline_missed(self.index, now - work.submitted, work.deadline - work.submitted, late_result=True)
        self.tally.settle(work.future, value, error, counted=work.kind in REQUEST_KINDS)

    def _deliver_batch(self, work: Work, values: Any, error: BaseException | None) -> None:
        """`values`: the output rank's list, one per member (RankRunner.step_batch made sure of it)."""
        members = work.members
        for i, member in enumerate(members):
            if error is not None:
                self.deliver(member, error=error)
            elif isinstance(values[i], BaseException):
                self.deliver(member, error=values[i])
            else:
                self.deliver(member, values[i])

    def finished(self, work: Work) -> None:
        """Every rank is done with `work`: free its slot, start the next one's running clock."""
        with self._lock:
            self._finish_locked(work)
        self._send_launches()

    def _finish_locked(self, work: Work) -> None:
        was_head = bool(self._dispatched) and self._dispatched[0] is work
        try:
            self._dispatched.remove(work)
        except ValueError:
            return  # already failed out by a group failure or close
        self._last_finish = time.monotonic()
        if was_head and work.kind != CALL:
            self.service.record(self._last_finish - max(self._head_since, work.dispatched))
        if was_head and self._dispatched:
            self._head_since = time.monotonic()
            self._arm(self._head_since + self._dispatched[0].limit_s)
        self._pump()
        if not self._dispatched and self._draining:
            self._idle.notify_all()  # wake drain()

    def complete(self, work: Work, value: Any = None, error: BaseException | None = None) -> None:
        """`deliver` and `finished` in one lock hold (one rank: its reply is its finish). The slot is
        free before the caller wakes, so its next submit does not queue behind this bookkeeping."""
        with self._lock:
            self.deliver(work, value, error)
            self._finish_locked(work)
        if self._to_launch:
            self._send_launches()

    def _cancelled(self, future: EngineFuture) -> None:
        """A queued future was cancelled by its caller: it leaves the queue, nothing reaches a rank."""
        with self._lock:
            try:
                self._queued.remove(future.work)
            except ValueError:
                pass

    # -- holding (pause, sleep, weight update) -----------------------------------------------------
    def hold(self) -> None:
        """Stop dispatching requests; they keep queueing (within their deadlines)."""
        with self._lock:
            self._held = True

    def release(self) -> None:
        """Dispatch again, starting with what queued meanwhile."""
        with self._lock:
            self._held = False
            self._pump()
        self._send_launches()

    def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is at the ranks (call after `hold`); False when `timeout_s` ran out."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._draining += 1
            try:
                while self._dispatched and self._refusal is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._idle.wait(timeout=left)
                return True
            finally:
                self._draining -= 1

    def abort_queued(self, error: Callable[[], BaseException]) -> int:
        """Fail every queued request with `error()`; returns how many."""
        with self._lock:
            queued, self._queued = list(self._queued), deque()
        for work in queued:
            self.deliver(work, error=error())
        return len(queued)

    # -- stopping -------------------------------------------------------------------------------
    def stop(self, refusal: Callable[[], BaseException], *, cancel_queued: bool,
             fail_dispatched: bool = True) -> None:
        """Refuse new work from now on; cancel or fail what is queued; fail what is dispatched."""
        with self._lock:
            self._refusal = refusal
            queued, self._queued = list(self._queued), deque()
            dispatched = list(self._dispatched) if fail_dispatched else []
            if fail_dispatched:
                self._dispatched.clear()
            self._cond.notify_all()
            self._idle.notify_all()
        for work in queued:
            if not (cancel_queued and work.future.cancel()):
                self.deliver(work, error=refusal())
        for work in dispatched:
            for request in work.requests() or [work]:
                self.deliver(request, error=refusal())

    def dispatched_work(self) -> list[Work]:
        with self._lock:
            return list(self._dispatched)
