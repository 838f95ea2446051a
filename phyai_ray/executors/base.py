"""`ScheduledReplica`: the one concrete replica, built from parts it owns; and the status the engine
reports per replica.

    ScheduledReplica
        queue      StepQueue or IterationLoop (queues.py): where requests wait
        scheduler  ReplicaScheduler (scheduler.py): in-order dispatch, the clocks, exact counts
        lifecycle  ReplicaControl (control.py): pause, sleep, wake, weight updates
        ranks      a RankTransport (replica.py): inline, torchrun (external.py) or Ray (actors/transport.py)

It satisfies the `Replica` protocol (replica.py), which is all the engine and the dispatcher use.
The transport reports back only through the `ReplicaLink` it is bound to; the failure path is
written once, here: `fail(error)` marks the replica unavailable, fails every queued and dispatched
request with the cause, then lets the transport release the ranks.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.batching import BatchPolicy
from phyai_ray.executors.control import ControlReport, ReplicaControl, ReplicaState
from phyai_ray.executors.futures import CallbackThread
from phyai_ray.executors.iterations import IterationLoop
from phyai_ray.executors.ledger import Counts
from phyai_ray.executors.queues import RequestQueue, StepQueue
from phyai_ray.executors.replica import RankTransport, Replica, ReplicaLink
from phyai_ray.executors.scheduler import ReplicaScheduler
from phyai_ray.work import CALL, ITERATE, STEP, Work

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
    """One WHOLE model replica (one rank or many), fed by its own `ReplicaScheduler` (see the module
    docstring). `ranks` is started already; `index` and `world_size` name the replica."""

    def __init__(self, ranks: RankTransport, *, index: int = 0, max_ongoing: int | None = 2,
                 max_queued: int | None = None, step_limit_s: float = 600.0, batching: Any = None,
                 entry: Any = None) -> None:
        self.index, self.world_size, self.ranks = index, ranks.world_size, ranks
        self._step_limit_s = step_limit_s
        self._failure: EngineUnavailableError | None = None
        self._failure_lock = threading.Lock()
        self.scheduler = ReplicaScheduler(index, max_ongoing=max_ongoing, max_queued=max_queued,
                                          launch=ranks.launch, on_hung=self._on_hung,
                                          delivery=CallbackThread(f"phyai-replica-{index}-callbacks"))
        self.queue: RequestQueue = StepQueue(self.scheduler, ranks, step_limit_s)
        self.lifecycle = ReplicaControl(index, self.scheduler, self.queue, ranks=ranks.control, fail=self.fail,
                                        failure=lambda: self._failure, unavailable_error=self.unavailable_error)
        ranks.bind(ReplicaLink(deliver=self.scheduler.deliver, finished=self.scheduler.finished,
                               complete=self.scheduler.complete, fail=self.fail, failure=lambda: self._failure,
                               unavailable_error=self.unavailable_error, batching=lambda: self.batching))
        if not ranks.lockstep:  # ranks run by separate engines must run the same steps: no batching there
            self.enable_batching(batching, ranks.batchable)
            if entry is not None:
                self.enable_iterations(entry, batching, ranks.iterative)

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
        if deadline is None:  # the fast path: an idle replica runs it on this thread, no future at all
            outcome = self.scheduler.run_here(payload, self._step_limit_s, ranks.step_here)
            if outcome is not None:
                return outcome
        future = self.scheduler.submit(STEP, payload, self._step_limit_s, here=True, key=key, size=size,
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
            return self.scheduler.submit(CALL, payload, timeout_s, all_ranks=all_ranks, bypass_queue=True)

    def run_iteration(self, plan: Any) -> Future:
        """Send one iteration's plan to every rank, after what is already dispatched; the future holds
        the output rank's deltas. Only the iteration loop calls it, never while the replica is held.
        A rank in this process runs it on the loop's own thread when nothing else is at the rank."""
        ranks = self.ranks
        future = self.scheduler.submit(ITERATE, ranks.prepare(plan), self._step_limit_s, bypass_queue=True,
                                       here=ranks.runs_here)
        if future.work.here:
            ranks.run_here(future.work)
        return future

    # -- how requests are batched -------------------------------------------------------------
    def enable_iterations(self, entry: Any, batching: Any, iterative: bool) -> None:
        """Batch per iteration when the plugin splits requests into sequences and every rank's model
        implements the iteration protocol (`phyai_ray.plugins.iteration`)."""
        if batching is None or not entry.iterative:
            return
        if not iterative:
            logger.info("replica %d: plugin %s splits requests into sequences, but its per-rank model lacks the "
                        "iteration protocol (admit, drop, recompute, iterate); every request runs as a step of its "
                        "own", self.index, entry.display_name())
            return
        scheduler = self.scheduler
        self.queue = IterationLoop(self.index, entry, batching, run_iteration=self.run_iteration,
                                   delivery=scheduler.delivery, record=scheduler.record, on_failure=self.fail,
                                   limit_s=self._step_limit_s, max_queued=scheduler.max_queued)
        self.lifecycle.queue = self.queue

    def enable_batching(self, batching: Any, batchable: bool) -> None:
        """Turn on batch dispatch when `batching` asks for it and every rank's model has `step_batch`."""
        if batching is not None:
            self.scheduler.edf = batching.scheduling == "deadline"
            self.scheduler.default_deadline_s = batching.default_deadline_s
        if batching is None or not batching.enabled:
            return
        if not batchable:
            logger.info("replica %d: max_batch_size=%d, but the plugin's per-rank model has no step_batch(requests); "
                        "every request runs as a step of its own", self.index, batching.max_batch_size)
            return
        self.scheduler.policy = BatchPolicy(batching.max_batch_size, batching.max_delay_s,
                                            tuple(batching.preferred_batch_sizes), self.ranks.max_batch_weight)
        logger.info("replica %d: batching up to %d samples per step (max_batch_delay_ms=%s)", self.index,
                    batching.max_batch_size, batching.max_batch_delay_ms)

    @property
    def batching(self) -> bool:
        return self.scheduler.policy is not None

    @property
    def iterative(self) -> bool:
        return self.queue.iterative

    # -- what routing and status read -----------------------------------------------------------
    def counts(self) -> Counts:
        mine, held = self.scheduler.counts(), self.queue.counts()
        return Counts(mine.queued + held.queued, mine.dispatched + held.dispatched, mine.served + held.served,
                      mine.errored + held.errored)

    def has_room(self) -> bool:
        return self._failure is None and self.queue.has_room()

    @property
    def max_queued(self) -> int | None:
        return self.scheduler.max_queued

    def carry_counts(self, replaced: Replica) -> None:
        """Continue the served / errored totals of the replica this one replaces."""
        self.scheduler.tally.carry(replaced.counts())

    def batch_stats(self) -> dict[str, Any]:
        """Histograms of samples per step and queue waits; the iteration loop's sequences and timings."""
        return {**self.scheduler.batch_snapshot(), **self.queue.snapshot()}

    @property
    def transport(self) -> str:
        """How requests reach the ranks: "inline", "torchrun", or the Ray lane ("ipc", "compiled",
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
        return self.scheduler.weight_version

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
        self.scheduler.stop(self.unavailable_error, cancel_queued=False)
        self.ranks.abandon()

    def _on_hung(self, work: Work, running_s: float) -> None:
        limit = (f"its collective_rpc timeout of {work.limit_s}s" if work.kind == CALL
                 else f"execution_timeout_s={work.limit_s}")
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
            self.scheduler.stop(self.unavailable_error, cancel_queued=True, fail_dispatched=False)
        self.ranks.close(drain=first)
        if first:
            self.scheduler.stop(self.unavailable_error, cancel_queued=True)

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
