"""`RankPipeline`: what is at one replica's ranks, in order, at most `max_ongoing` at once.

    request queue --feed()--> [dispatched ........ max_ongoing] --executor.launch--> the ranks
    send(kind, ...)  -------> (collective_rpc, iterations: at once, after what is there)

* The pipeline holds the work sent to the ranks: requests and batches dispatched by the replica's
  request queue (`StepQueue`, queues.py, which it asks for more through `feed()` whenever a slot
  frees), and collective_rpc calls and iterations, which `send` dispatches at once: they run on the
  ranks right after what is already there, in the same order on every rank.
* At most `max_ongoing` are at the ranks at once (a short pipeline: the ranks always have the next
  request, and never hold thousands of calls); `hold()` stops dispatch (pause, sleep, weight update)
  and `drain()` waits until nothing is left at the ranks.
* The hang clock (it watches the replica's `DeadlineClock`, clock.py): the replica is judged hung
  only when the head of the line has been RUNNING for its limit; running counts from when its
  predecessor finished, or from its dispatch if later. Load alone never fails a replica. A
  dispatched request past its own limit fails with `RequestTimeoutError` but still runs, because
  ranks that share collectives cannot skip it one-sidedly.
* Replies come back through `deliver`, `finished` and `complete` (the executor's `ReplicaLink`);
  every exit path keeps `dispatched`, `served` and `errored` exact. A batch's output-rank list is
  handed out member by member.
* `run_here` is the inline fast path: `Engine.step` on an idle inline replica runs the step on the
  caller's thread with no future (the general path, a `Work` queued and a `concurrent.futures.Future`
  settled by another thread, cost 34 us per no-op step on a 2-core VM; this one 6-7 us).

Its collaborators are given: the replica's `executor` (launch, prepare, run_here, runs_here:
replica.py), the lock it shares with the request queue and the clock, `on_hung(work, running_s)`,
and the `delivery` thread of its futures' callbacks. `launch` is called in dispatch order but
outside the lock (N actor calls, or a copy of a large body), by one thread at a time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Protocol

from phyai_ray.executors.batching import BatchStats
from phyai_ray.executors.clock import DeadlineClock
from phyai_ray.executors.futures import CallbackThread, EngineFuture, HereResult
from phyai_ray.executors.ledger import Counts, Tally, deadline_missed, timeout_error
from phyai_ray.executors.service import ServiceTime
from phyai_ray.work import BATCH, CALL, ITERATE, REQUEST_KINDS, STEP, Work


class Feeder(Protocol):
    """Where the pipeline asks for more work when a slot frees (the request queue); lock held."""

    def feed(self) -> None:
        """Dispatch waiting requests while the pipeline has room."""

    def waiting(self) -> bool:
        """Whether any request waits."""


class _NothingWaits:
    def feed(self) -> None:
        pass

    def waiting(self) -> bool:
        return False


def _never_queued(future: EngineFuture) -> None:
    """The cancel hook of work dispatched at once: its future is running, so cancel() never reaches here."""


class RankPipeline:
    """The dispatched line of one replica (see the module docstring); thread-safe under the shared lock."""

    def __init__(self, index: int, executor: Any, *, max_ongoing: int | None, lock: threading.RLock,
                 clock: DeadlineClock, on_hung: Callable[[Work, float], None], delivery: CallbackThread,
                 limit_s: float = 600.0) -> None:
        self.index, self.max_ongoing, self.limit_s = index, max_ongoing, limit_s
        self._executor, self._launch, self._on_hung, self.delivery = executor, executor.launch, on_hung, delivery
        self._lock, self._clock = lock, clock
        self._idle = threading.Condition(lock)  # drain() waits on it: a finish must not wake the clock
        self._draining = 0  # threads in drain()
        self._dispatched: deque[Work] = deque()
        self._to_launch: deque[Work] = deque()  # dispatched, not yet sent (see send_launches)
        self._launching = threading.Lock()
        self._head_since = 0.0
        self._reported_hung: Work | None = None  # a head reported hung once is not reported (or waited for) again
        self._feeder: Feeder = _NothingWaits()
        self._refusal: Callable[[], BaseException] | None = None  # set once the replica stops
        self.held = False  # paused, asleep or updating: nothing is dispatched
        self.weight_version: Any = None  # stamped on every future at dispatch
        self.last_finish = float("-inf")  # when the ranks last finished a step
        self.tally = Tally()
        self.stats = BatchStats()
        self.service = ServiceTime()  # recent step time: finish-by admission and the batch delay's cap
        clock.watch(self._next_deadline, self.expire)

    def feed_from(self, feeder: Feeder) -> None:
        """Once: the request queue that fills the pipeline's free slots."""
        self._feeder = feeder

    # -- what the request queue asks (lock held) --------------------------------------------------
    def has_slot(self) -> bool:
        return self.max_ongoing is None or len(self._dispatched) < self.max_ongoing

    def idle(self) -> bool:
        """Nothing at the ranks and not held: a request dispatched now runs at once."""
        return not self.held and not self._dispatched

    @property
    def stopped(self) -> Callable[[], BaseException] | None:
        """The refusal of a stopped pipeline (None while it runs)."""
        return self._refusal

    def describe(self) -> str:
        return f"{len(self._dispatched)} at the ranks (max_ongoing_requests={self.max_ongoing})"

    def dispatch(self, work: Work) -> None:
        """Put `work` at the end of the line (lock held); it is launched by `send_launches` unless `here`."""
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
            self._clock.arm(work.dispatched + self.hang_s(work))
        if not work.here:
            self._to_launch.append(work)

    def send_launches(self) -> None:
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

    # -- work sent at once ------------------------------------------------------------------------
    def send(self, kind: str, payload: Any, limit_s: float, *, all_ranks: bool = False,
             here: bool = False) -> EngineFuture:
        """Dispatch a collective_rpc or an iteration now, after what is at the ranks; its future.
        `here`: when nothing is at the ranks, `future.work.here` is set and the caller runs it itself."""
        future = EngineFuture(self.delivery, _never_queued)
        work = Work(kind, payload, limit_s, future, all_ranks)
        future.work, future.replica = work, self.index
        with self._lock:
            if self._refusal is not None:
                raise self._refusal()
            future.start()
            work.here = here and not self._dispatched
            self.dispatch(work)
            self._clock.arm(work.submitted + limit_s)
        self.send_launches()
        return future

    def run_iteration(self, plan: Any) -> EngineFuture:
        """One iteration's plan to every rank (the iteration loop's launch); a rank in this process
        runs it on the loop's own thread when nothing else is at the rank."""
        executor = self._executor
        future = self.send(ITERATE, executor.prepare(plan), self.limit_s, here=executor.runs_here)
        if future.work.here:
            executor.run_here(future.work)
        return future

    def record(self, size: int, waits: list[float]) -> None:
        """One batch of `size` (an iteration's sequences) and the queue wait of each newcomer (histograms)."""
        with self._lock:
            self.stats.record(size, waits)

    def run_here(self, payload: Any, limit_s: float, run: Callable[[Any], Any]) -> HereResult | None:
        """The inline fast path (batching off): when nothing waits, is at the ranks or holds them, run a
        plain step on this thread now (`run(payload)`) and return its outcome; None otherwise (then
        queue it as usual). It counts as dispatched meanwhile, so the hang clock and the accounting see
        it and other callers queue behind it. Its outcome is a `HereResult`, not a future: the clock or
        a failure may set it first (the caller then gets theirs), but nobody ever waits on it."""
        with self._lock:
            if self._refusal is not None or self.held or self._dispatched or self._feeder.waiting():
                return None
            work = Work(STEP, payload, limit_s, None)
            work.future = outcome = HereResult(self.index, self._lock)
            work.here = True
            now = work.dispatched = self._head_since = outcome.started = time.monotonic()  # `dispatch`, unrolled
            outcome.weight_version = self.weight_version
            self.stats.record_here(now - work.submitted)
            self._dispatched.append(work)
            self._clock.arm(now + limit_s)
        try:
            value, error = run(payload), None
        except BaseException as exc:  # the plugin's own exception goes to the caller as is
            value, error = None, exc
        with self._lock:  # every setter of the outcome holds this lock: it is unset unless one came first
            if not outcome._done:
                outcome.finished, outcome._value, outcome._error, outcome._done = time.monotonic(), value, error, True
                self.tally.count(error)
            line = self._dispatched
            if len(line) == 1 and line[0] is work and not self._draining and not self._feeder.waiting():
                line.pop()  # `_finish_locked` of the one thing at the rank, with nothing waiting behind it
                self.last_finish = now = time.monotonic()
                self.service.record(now - work.dispatched)
            else:
                self._finish_locked(work)
        if self._to_launch:
            self.send_launches()
        work.future = None  # no work <-> outcome cycle for the cyclic collector
        return outcome

    # -- completion -----------------------------------------------------------------------------
    def deliver(self, work: Work, value: Any = None, error: BaseException | None = None) -> None:
        """Resolve `work`'s future (it may still be running on other ranks); requests are counted once.

        A batch: `error` fails every member; else `value` is the output rank's list, one result per
        member in order, where an exception instance fails only its member."""
        if work.kind == BATCH:
            for i, member in enumerate(work.members):
                if error is not None:
                    self.deliver(member, error=error)
                elif isinstance(value[i], BaseException):
                    self.deliver(member, error=value[i])
                else:
                    self.deliver(member, value[i])
            return
        if work.future is None:  # settled and released by the thread that ran it (Replica.submit)
            return
        if error is None and work.late == "drop" and work.missed(time.monotonic()):
            now = time.monotonic()
            error = deadline_missed(self.index, now - work.submitted, work.deadline - work.submitted, late_result=True)
        self.tally.settle(work.future, value, error, counted=work.kind in REQUEST_KINDS)

    def finished(self, work: Work) -> None:
        """Every rank is done with `work`: free its slot, start the next one's running clock."""
        with self._lock:
            self._finish_locked(work)
        self.send_launches()

    def complete(self, work: Work, value: Any = None, error: BaseException | None = None) -> None:
        """`deliver` and `finished` in one lock hold (one rank: its reply is its finish). The slot is
        free before the caller wakes, so its next submit does not queue behind this bookkeeping."""
        with self._lock:
            self.deliver(work, value, error)
            self._finish_locked(work)
        if self._to_launch:
            self.send_launches()

    def _finish_locked(self, work: Work) -> None:
        line = self._dispatched
        was_head = bool(line) and line[0] is work
        try:
            line.remove(work)
        except ValueError:
            return  # already failed out by a group failure or close
        self.last_finish = time.monotonic()
        if was_head and work.kind != CALL:
            self.service.record(self.last_finish - max(self._head_since, work.dispatched))
        if was_head and line:
            self._head_since = time.monotonic()
            self._clock.arm(self._head_since + self.hang_s(line[0]))
        if self._refusal is None and not self.held:
            self._feeder.feed()
        if not line and self._draining:
            self._idle.notify_all()  # wake drain()

    # -- holding (pause, sleep, weight update) -----------------------------------------------------
    def hold(self) -> None:
        """Stop dispatching requests; they keep queueing (within their deadlines)."""
        with self._lock:
            self.held = True

    def release(self) -> None:
        """Dispatch again, starting with what queued meanwhile."""
        with self._lock:
            self.held = False
            if self._refusal is None:
                self._feeder.feed()
        self.send_launches()

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

    # -- the hang clock ---------------------------------------------------------------------------
    def hang_s(self, work: Work) -> float:
        """How long `work` may run at the head of the line: a collective_rpc its own timeout, anything
        else (a step, a batch, a stream, one iteration) the replica's hang limit `limit_s`."""
        return work.limit_s if work.kind == CALL else self.limit_s

    def _next_deadline(self) -> float:
        """Lock held: when a dispatched request expires, or the head would be hung."""
        line = self._dispatched
        times = [r.expires for w in line for r in (w.requests() if w.kind == BATCH else [w]) if not r.future.done()]
        if line and line[0] is not self._reported_hung:
            times.append(self._head_since + self.hang_s(line[0]))
        return min(times, default=float("inf"))

    def expire(self, now: float) -> None:
        """Fail dispatched requests past their limit (they still run), or report the hung head once."""
        with self._lock:
            if self._refusal is not None:
                return
            line = self._dispatched
            head = line[0] if line else None
            running_s = now - self._head_since
            if head is not None and head is not self._reported_hung and running_s >= self.hang_s(head):
                self._reported_hung = head
                expired = None
            else:
                expired = [r for w in line for r in (w.requests() if w.kind == BATCH else [w])
                           if r.expires <= now and not r.future.done()]
        if expired is None:
            self._on_hung(head, running_s)
            return
        for work in expired:
            self.deliver(work, error=timeout_error(self.index, work, now))

    # -- what status reads; stopping ------------------------------------------------------------------
    def counts(self) -> Counts:
        """Requests at the ranks without an outcome yet, and the served / errored totals."""
        with self._lock:
            running = sum(1 for w in self._dispatched for r in w.requests() if not r.future.done())
            return Counts(0, running, self.tally.served, self.tally.errored)

    def batch_snapshot(self) -> dict[str, Any]:
        """Histograms of samples per dispatched step and of each request's queue wait."""
        with self._lock:
            return self.stats.snapshot()

    def dispatched_work(self) -> list[Work]:
        with self._lock:
            return list(self._dispatched)

    def stop(self, refusal: Callable[[], BaseException], *, fail_dispatched: bool = True) -> None:
        """Refuse new work from now on; fail what is at the ranks (unless `fail_dispatched` is False)."""
        with self._lock:
            self._refusal = refusal
            dispatched = list(self._dispatched) if fail_dispatched else []
            if fail_dispatched:
                self._dispatched.clear()
            self._idle.notify_all()
        for work in dispatched:
            for request in work.requests() or [work]:
                self.deliver(request, error=refusal())
