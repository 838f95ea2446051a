"""The contract every replica executor keeps, and the status the engine reports per replica."""

from __future__ import annotations

import abc
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.batching import BatchPolicy
from phyai_ray.executors.control import ReplicaControl
from phyai_ray.executors.futures import CallbackThread
from phyai_ray.executors.frontends import StepQueue
from phyai_ray.executors.iterations import IterationLoop
from phyai_ray.executors.ledger import Counts
from phyai_ray.executors.scheduler import ReplicaScheduler
from phyai_ray.work import Work
from phyai_ray.work import Kind

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


class ReplicaExecutor(ReplicaControl, abc.ABC):
    """One WHOLE model replica (one rank or many), fed by its own `ReplicaScheduler`.

    Subclasses supply `_launch(work)` (hand one dispatched request to every rank, in order),
    `_teardown()` (release ranks and resources) and may override `_prepare(payload)` (serialize
    once, in the caller's thread, before anything is queued: a bad payload loses nothing) and
    `_hang_detail(work)`. The failure path is written once, here: `_fail(error)` marks the replica
    unavailable, fails every queued and dispatched request with the cause, then tears down.
    """

    def __init__(self, index: int, world_size: int, *, max_ongoing: int | None = 2,
                 max_queued: int | None = None, step_limit_s: float = 600.0) -> None:
        self.index, self.world_size = index, world_size
        self._step_limit_s = step_limit_s
        self._failure: EngineUnavailableError | None = None
        self._failure_lock = threading.Lock()
        self._init_control()
        self.scheduler = ReplicaScheduler(index, max_ongoing=max_ongoing, max_queued=max_queued,
                                          launch=self._launch, on_hung=self._on_hung,
                                          delivery=CallbackThread(f"phyai-replica-{index}-callbacks"))
        self.frontend: StepQueue | IterationLoop = StepQueue(self)  # where requests wait (frontends.py)

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: Any, *, caller_runs: bool = False, key: Any = None, size: int = 1,
               due: float | None = None) -> Future:
        """Queue `request` for every rank; the future resolves to the output rank's result.

        Raises EngineUnavailableError when the replica failed, EngineOverloadedError when its
        queue is full (nothing was queued in either case). `caller_runs` is a hint from a caller
        that is about to wait anyway (`Engine.step`): an executor whose rank lives in this process
        may then run the request on the calling thread; the others ignore it. `key` and `size`
        (the plugin's `batch_key` / `request_size`) place the request in a batch when batching is on;
        `due` is its own deadline (monotonic seconds), which orders the queue and bounds its wait.
        """
        self._check_healthy()
        return self.frontend.submit(request, key=key, size=size, due=due)

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
        self.frontend = IterationLoop(self, entry, batching, limit_s=self._step_limit_s,
                                      max_queued=self.scheduler.max_queued)
        logger.info("replica %d: continuous batching, up to %d sequences and %d tokens per iteration", self.index,
                    batching.max_num_seqs, batching.max_num_batched_tokens)

    def run_iteration(self, plan: Any) -> Future:
        """Send one iteration's plan to every rank, after what is already dispatched; the future holds
        the output rank's deltas. Only the iteration loop calls it, never while the replica is held."""
        return self.scheduler.submit(Kind.ITERATE, self._prepare(plan), self._step_limit_s, bypass_queue=True)

    def enable_batching(self, batching: Any, batchable: bool) -> None:
        """Turn on batch dispatch when `batching` asks for it and every rank's model has `step_batch`."""
        if batching is not None:
            self.scheduler.edf = batching.scheduling == "deadline"
        if batching is None or not batching.enabled:
            return
        if not batchable:
            logger.info("replica %d: max_batch_size=%d, but the plugin's per-rank model has no step_batch(requests); "
                        "every request runs as a step of its own", self.index, batching.max_batch_size)
            return
        self.scheduler.policy = BatchPolicy(batching.max_batch_size, batching.max_delay_s,
                                            tuple(batching.preferred_batch_sizes), self._max_batch_weight())
        logger.info("replica %d: batching up to %d samples per step (max_batch_delay_ms=%s)", self.index,
                    batching.max_batch_size, batching.max_batch_delay_ms)

    @property
    def batching(self) -> bool:
        return self.scheduler.policy is not None

    def _weight(self, payload: Any) -> int:
        """What one prepared request costs against `_max_batch_weight` (e.g. descriptors it carries)."""
        return 0

    def _max_batch_weight(self) -> int | None:
        return None

    def submit_stream(self, request: Any, max_buffered: int) -> tuple[Future, Any]:
        """Queue a streamed request; returns its future (the final result) and a chunk reader."""
        self._check_healthy()
        return self.frontend.submit_stream(request, max_buffered)

    def _submit_stream(self, request: Any, max_buffered: int) -> tuple[Future, Any]:
        raise TypeError(f"{type(self).__name__} cannot stream")

    def collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout_s: float,
                       all_ranks: bool = False) -> Future:
        """Call `method` of the per-rank model on every rank, right after the dispatched requests
        (never beside a control call, refused while UPDATING: see `control.rpc_admission`)."""
        self._check_healthy()
        payload = self._prepare((method, tuple(args), dict(kwargs)))
        with self.rpc_admission(timeout_s):
            return self.scheduler.submit(Kind.CALL, payload, timeout_s, all_ranks=all_ranks, bypass_queue=True)

    def counts(self) -> Counts:
        mine, held = self.scheduler.counts(), self.frontend.counts()
        return Counts(mine.queued + held.queued, mine.dispatched + held.dispatched, mine.served + held.served,
                      mine.errored + held.errored)

    def has_room(self) -> bool:
        return self.healthy and self.frontend.has_room()

    def _prepare(self, payload: Any) -> Any:
        return payload

    @abc.abstractmethod
    def _launch(self, work: Work) -> None:
        """Send dispatched `work` to every rank (called in dispatch order, outside the scheduler's lock,
        by one thread at a time)."""

    @abc.abstractmethod
    def _control_ranks(self, op: str, args: tuple, timeout_s: float) -> Future:
        """Run control op `op(*args)` on every rank's control lane; the future holds the replies in rank order."""

    @abc.abstractmethod
    def _teardown(self) -> None:
        """Stop the ranks and release what the replica holds. Idempotent."""

    # -- failure ----------------------------------------------------------------------------
    def _fail(self, error: EngineUnavailableError) -> None:
        """The one failure path: mark unavailable, fail all queued and dispatched work, tear down."""
        if not self._set_failure(error):
            return
        logger.error("%s", error)
        self._stop_iterations()
        self.scheduler.stop(self.unavailable_error, cancel_queued=False)
        self._teardown_after_failure()

    def _stop_iterations(self, cancel_waiting: bool = False) -> None:
        self.frontend.stop(self.unavailable_error, cancel_waiting=cancel_waiting)

    def _teardown_after_failure(self) -> None:
        threading.Thread(target=self._teardown, name=f"phyai-replica-{self.index}-teardown", daemon=True).start()

    def _on_hung(self, work: Work, running_s: float) -> None:
        limit = (f"its collective_rpc timeout of {work.limit_s}s" if work.kind == Kind.CALL
                 else f"execution_timeout_s={work.limit_s}")
        rank, node, waiting = self._hang_detail(work)
        self._fail(EngineUnavailableError(
            f"replica {self.index}: a {work.kind} has been running on its ranks for {running_s:.1f}s, past {limit}; "
            f"{waiting}, so the replica was stopped (a request waiting behind others is not counted: only running "
            "time is)", reason="timeout", replica=self.index, rank=rank, node=node))

    def rank_args(self, op: str, args: tuple, rank: int) -> tuple:
        """A control op's arguments for one rank (a transfer group needs each rank's place in it)."""
        if op == "init_weight_transfer":
            return (*args, rank + 1, self.world_size + 1)  # group rank 0 is the trainer
        return args

    def _hang_detail(self, work: Work) -> tuple[int | None, str | None, str]:
        """(first rank that had not replied, its node, a phrase naming the ranks)."""
        return 0, None, "rank(s) [0] had not replied"

    def _check_healthy(self) -> None:
        if self._failure is not None:
            raise self.unavailable_error()

    @abc.abstractmethod
    def close(self) -> None:
        """Cancel queued work, fail unfinished work with EngineUnavailableError, release everything."""

    @property
    def healthy(self) -> bool:
        return self._failure is None

    @property
    def failure(self) -> EngineUnavailableError | None:
        return self._failure

    def nodes(self) -> tuple[str, ...]:
        """Node id of every rank, in rank order (empty when the replica runs in this process)."""
        return ()

    def pids(self) -> tuple[int, ...]:
        """Process id of every rank, in rank order."""
        import os
        return (os.getpid(),)

    def _set_failure(self, error: EngineUnavailableError) -> bool:
        """Record the first failure; returns False when one was already recorded."""
        with self._failure_lock:
            if self._failure is not None:
                return False
            self._failure = error
            return True

    def _closed_error(self) -> EngineUnavailableError:
        return EngineUnavailableError(f"replica {self.index} is closed", reason="closed", replica=self.index)

    def unavailable_error(self) -> EngineUnavailableError:
        """The error to raise for work sent to a failed replica."""
        cause = self._failure
        error = EngineUnavailableError(f"replica {self.index} is unavailable: {cause}", reason=cause.reason,
                                       replica=self.index, rank=cause.rank, node=cause.node, detail=cause.detail)
        error.__cause__ = cause
        return error
