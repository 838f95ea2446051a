"""`ScheduledReplica`: the one concrete replica, built from parts it owns; and the status the engine
reports per replica.

    ScheduledReplica
        queue      StepQueue (queues.py) or IterationLoop (iterations.py): where requests wait, batched
        pipeline   RankPipeline (pipeline.py): what is at the ranks, in order, at most max_ongoing
        clock      DeadlineClock (clock.py): one timer thread the queue and the pipeline watch
        lifecycle  ReplicaControl (control.py): pause, sleep, wake, weight updates (updates.py)
        ranks      its Executor (replica.py): InlineExecutor, ExternalExecutor (external.py) or
                   RayExecutor (actors/ray_executor.py)

Each part is given what it uses when the replica builds it; they share one lock. The replica
satisfies the `Replica` protocol (replica.py), which is all the engine and the dispatcher use. The
executor reports back only through the `ReplicaLink` it is bound to; the failure path is written
once, here: `fail(error)` marks the replica unavailable, fails every queued and dispatched request
with the cause, then lets the executor release the ranks.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.batching import BatchPolicy
from phyai_ray.executors.clock import DeadlineClock
from phyai_ray.executors.control import ControlReport, ReplicaControl, ReplicaState
from phyai_ray.executors.futures import CallbackThread
from phyai_ray.executors.iterations import IterationLoop
from phyai_ray.executors.ledger import Counts
from phyai_ray.executors.pipeline import RankPipeline
from phyai_ray.executors.queues import RequestQueue, StepQueue
from phyai_ray.executors.replica import Executor, Replica, ReplicaLink
from phyai_ray.work import CALL, STEP, Work

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaStatus:
    """What the engine knows about one replica; never waits behind a running step."""

    index: int
    healthy: bool
    world_size: int
    in_flight: int
    served: int
    errored: int
    queued: int = 0
    dispatched: int = 0
    state: str = "SERVING"
    weight_version: Any = None
    failure: str | None = None
    failure_reason: str | None = None
    failed_rank: int | None = None
    nodes: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ScheduledReplica:
    """One WHOLE model replica (one rank or many), scheduled by its own parts (see the module docstring).
    `ranks` is its executor, started already; `index` and `world_size` name the replica."""

    def __init__(self, ranks: Executor, *, index: int = 0, max_ongoing: int | None = 2,
                 max_queued: int | None = None, step_limit_s: float = 600.0, batching: Any = None,
                 entry: Any = None, hang_limit_s: float | None = None, cap_s: float | None = None) -> None:
        self.index, self.world_size, self.ranks = index, ranks.world_size, ranks
        self._step_limit_s = step_limit_s  # a step request's limit from submission
        self._hang_limit_s = step_limit_s if hang_limit_s is None else hang_limit_s  # one rank call's
        self._cap_s = cap_s  # an iterative request's cap (None: its deadline or estimate, executors/limits.py)
        self._failure: EngineUnavailableError | None = None
        self._failure_lock = threading.Lock()
        self._lock = lock = threading.RLock()  # shared by the queue, the pipeline and the clock
        self.clock = DeadlineClock(index, lock)
        self.pipeline = RankPipeline(index, ranks, max_ongoing=max_ongoing, lock=lock, clock=self.clock,
                                     on_hung=self._on_hung, limit_s=self._hang_limit_s,
                                     delivery=CallbackThread(f"phyai-replica-{index}-callbacks"))
        self.max_queued = max_queued
        batching = None if ranks.lockstep else batching  # ranks run by separate engines must run the same steps
        self.queue: RequestQueue = self._iteration_loop(entry, batching, ranks.iterative) or \
            self._step_queue(lock, batching, ranks.batchable)
        self._runs_here = ranks.runs_here and not self.queue.iterative and not self.batching
        self.lifecycle = ReplicaControl(index, self.pipeline, self.queue, ranks=ranks.control, fail=self.fail,
                                        failure=lambda: self._failure, unavailable_error=self.unavailable_error)
        pipeline = self.pipeline
        ranks.bind(ReplicaLink(deliver=pipeline.deliver, finished=pipeline.finished, complete=pipeline.complete,
                               fail=self.fail, failure=lambda: self._failure,
                               unavailable_error=self.unavailable_error, batching=lambda: self.batching))

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: Any, *, caller_runs: bool = False, key: Any = None, size: int = 1,
               deadline: float | None = None, late: str = "finish") -> Future:
        """Queue `request` for every rank; the future resolves to the output rank's result.

        Raises EngineUnavailableError when the replica failed, EngineOverloadedError when its
        queue is full (nothing was queued in either case). `caller_runs` is a hint from a caller
        that is about to wait anyway (`Engine.step`): a replica whose rank lives in this process
        runs the request on the calling thread when nothing is queued or running (it counts as
        dispatched meanwhile, so other callers queue behind it and the hang clock sees it); the
        others ignore it. `key` and `size` (the plugin's `batch_key` / `request_size`) place the
        request in a batch when batching is on; `deadline` is its own (monotonic seconds), which
        orders the queue and bounds its wait; `late="drop"` answers a result ready after it as
        missed. Ranks in lockstep (torchrun) take none of these: a rank that skipped a late request
        would leave the others in a collective.
        """
        if self._failure is not None:
            raise self.unavailable_error()
        ranks = self.ranks
        if ranks.lockstep:
            return self.queue.submit(request)
        if not (caller_runs and ranks.runs_here) or self.queue.iterative:
            return self.queue.submit(request, key=key, size=size, deadline=deadline, late=late)
        payload = ranks.prepare(request)
        if deadline is None and self._runs_here:  # the fast path: an idle replica runs it here, no future at all
            outcome = self.pipeline.run_here(payload, self._step_limit_s, ranks.step_here)
            if outcome is not None:
                return outcome
        future = self.queue.put(STEP, payload, self._step_limit_s, here=True, key=key, size=size,
                                weight=ranks.weight(payload), deadline=deadline, late=late)
        work = future.work
        if work.here:
            ranks.run_here(work)  # returns once the work is settled and its slot is free
            work.future = None  # breaks the future <-> work cycle: both are freed when the caller drops the
            # future, so a stream of step() calls leaves no garbage for the cyclic collector to find
        return future

    def submit_stream(self, request: Any, max_buffered: int, deadline: float | None = None) -> tuple[Future, Any]:
        """Queue a streamed request; returns its future (the final result) and a chunk reader."""
        if self._failure is not None:
            raise self.unavailable_error()
        return self.queue.submit_stream(request, max_buffered, deadline)

    def collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout_s: float,
                       all_ranks: bool = False) -> Future:
        """Call `method` of the per-rank model on every rank, right after the dispatched requests
        (never beside a control call, refused while UPDATING: see `control.rpc_admission`)."""
        if self._failure is not None:
            raise self.unavailable_error()
        payload = self.ranks.prepare((method, tuple(args), dict(kwargs)))
        with self.lifecycle.rpc_admission(timeout_s):
            return self.pipeline.send(CALL, payload, timeout_s, all_ranks=all_ranks)

    # -- the request queue, chosen once -----------------------------------------------------------
    def _iteration_loop(self, entry: Any, batching: Any, iterative: bool) -> IterationLoop | None:
        """Batch per iteration when the plugin splits requests into sequences and every rank's model
        implements the iteration protocol (`phyai_ray.plugins.iteration`)."""
        if batching is None or entry is None or not entry.iterative:
            return None
        if not iterative:
            logger.info("replica %d: plugin %s splits requests into sequences, but its per-rank model lacks the "
                        "iteration protocol (admit, drop, recompute, iterate); every request runs as a step of its "
                        "own", self.index, entry.display_name())
            return None
        self._batching = bool(batching.enabled and self.ranks.batchable)  # as reported (batch_stats); steps
        # never run here: every request is the loop's
        return IterationLoop(self.index, entry, batching, pipeline=self.pipeline, delivery=self.pipeline.delivery,
                             on_failure=self.fail, limit_s=self._hang_limit_s, max_queued=self.max_queued,
                             cap_s=self._cap_s)

    def _step_queue(self, lock: Any, batching: Any, batchable: bool) -> StepQueue:
        """Requests as steps; batch dispatch when `batching` asks for it and every rank's model has `step_batch`."""
        queue = StepQueue(self.index, self.pipeline, self.ranks, lock=lock, clock=self.clock,
                          limit_s=self._step_limit_s, max_queued=self.max_queued)
        self._batching = False
        if batching is not None:
            queue.edf = batching.scheduling == "deadline"
            queue.default_deadline_s = batching.default_deadline_s
        if batching is None or not batching.enabled:
            return queue
        if not batchable:
            logger.info("replica %d: max_batch_size=%d, but the plugin's per-rank model has no step_batch(requests); "
                        "every request runs as a step of its own", self.index, batching.max_batch_size)
            return queue
        queue.policy = BatchPolicy(batching.max_batch_size, batching.max_delay_s,
                                   tuple(batching.preferred_batch_sizes), self.ranks.max_batch_weight)
        self._batching = True
        logger.info("replica %d: batching up to %d samples per step (max_batch_delay_ms=%s)", self.index,
                    batching.max_batch_size, batching.max_batch_delay_ms)
        return queue

    @property
    def batching(self) -> bool:
        """Whether requests are batched per step."""
        return self._batching

    @property
    def iterative(self) -> bool:
        return self.queue.iterative

    # -- what routing and status read -----------------------------------------------------------
    def counts(self) -> Counts:
        if self.queue.iterative:  # the loop's lock is taken before the pipeline's (never the other way)
            at_ranks, held = self.pipeline.counts(), self.queue.counts()
        else:
            with self._lock:  # one reading: a request moving onto the pipeline is counted once
                at_ranks, held = self.pipeline.counts(), self.queue.counts()
        return Counts(held.queued, at_ranks.dispatched + held.dispatched, at_ranks.served + held.served,
                      at_ranks.errored + held.errored)

    def has_room(self) -> bool:
        return self._failure is None and self.queue.has_room()

    def carry_counts(self, replaced: Replica) -> None:
        """Continue the served / errored totals of the replica this one replaces."""
        self.pipeline.tally.carry(replaced.counts())

    def batch_stats(self) -> dict[str, Any]:
        """Histograms of samples per step and queue waits; the iteration loop's sequences and timings."""
        return {**self.pipeline.batch_snapshot(), **self.queue.snapshot()}

    @property
    def transport(self) -> str:
        """How requests reach the ranks (the executor's name): "inline", "torchrun", or the Ray lane ("ipc", "compiled",
        "actor_calls": actors/lane.py)."""
        return self.ranks.name

    def nodes(self) -> tuple[str, ...]:
        """Node id of every rank, in rank order (empty when the replica runs in this process)."""
        return self.ranks.nodes()

    def pids(self) -> tuple[int, ...]:
        """Process id of every rank, in rank order."""
        return self.ranks.pids()

    # -- control (the lifecycle's) --------------------------------------------------------------
    def control(self, op: str, args: tuple = (), *, timeout_s: float, mode: str = "wait") -> ControlReport:
        return self.lifecycle.control(op, args, timeout_s=timeout_s, mode=mode)

    def check_transition(self, op: str) -> None:
        self.lifecycle.check_transition(op)

    def failed_report(self, op: str, error: BaseException, started: float) -> ControlReport:
        return self.lifecycle.failed_report(op, error, started)

    @property
    def state(self) -> ReplicaState:
        return self.lifecycle.state

    @property
    def serving(self) -> bool:
        return self.lifecycle.serving

    @property
    def weight_version(self) -> Any:
        return self.pipeline.weight_version

    @property
    def pending_version(self) -> Any:
        return self.lifecycle.pending_version

    # -- failure ----------------------------------------------------------------------------
    def fail(self, error: EngineUnavailableError) -> None:
        """The one failure path: mark unavailable, fail all queued and dispatched work, release the ranks."""
        if not self._set_failure(error):
            return
        logger.error("%s", error)
        self.queue.stop(self.unavailable_error)
        self.pipeline.stop(self.unavailable_error)
        self.clock.stop()
        self.ranks.abandon()

    def _on_hung(self, work: Work, running_s: float) -> None:
        limit = (f"its collective_rpc timeout of {work.limit_s}s" if work.kind == CALL else f"the hang limit of "
                 f"{self._hang_limit_s}s (rank_call_timeout_s, else execution_timeout_s)")
        rank, node, waiting = self.ranks.hang_detail(work)
        self.fail(EngineUnavailableError(
            f"replica {self.index}: a {work.kind} has been running on its ranks for {running_s:.1f}s, past {limit}; "
            f"{waiting}, so the replica was stopped (a request waiting behind others is not counted: only running "
            "time is)", reason="timeout", replica=self.index, rank=rank, node=node))

    def close(self) -> None:
        """Cancel queued work, let the running call finish where the ranks allow it (bounded), fail what
        is left, release the ranks. Idempotent."""
        first = self._set_failure(EngineUnavailableError(f"replica {self.index} is closed", reason="closed",
                                                         replica=self.index))
        if first:
            self.queue.stop(self.unavailable_error, cancel_waiting=True)
            self.pipeline.stop(self.unavailable_error, fail_dispatched=False)
            self.clock.stop()
        self.ranks.close(drain=first)
        if first:
            self.pipeline.stop(self.unavailable_error)

    @property
    def healthy(self) -> bool:
        return self._failure is None

    @property
    def failure(self) -> EngineUnavailableError | None:
        return self._failure

    def _set_failure(self, error: EngineUnavailableError) -> bool:
        """Record the first failure; returns False when one was already recorded."""
        with self._failure_lock:
            if self._failure is not None:
                return False
            self._failure = error
            return True

    def unavailable_error(self) -> EngineUnavailableError:
        """The error to raise for work sent to a failed replica."""
        cause = self._failure
        error = EngineUnavailableError(f"replica {self.index} is unavailable: {cause}", reason=cause.reason,
                                       replica=self.index, rank=cause.rank, node=cause.node, detail=cause.detail)
        error.__cause__ = cause
        return error
