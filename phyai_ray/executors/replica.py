"""The two narrow contracts of a replica: what the engine uses (`Replica`) and what a replica asks of the
executor that runs its ranks (`Executor`).

    Engine / RequestDispatcher --Replica--> ScheduledReplica (base.py) --Executor--> the ranks
                                            owns: request queue (StepQueue or        InlineExecutor:   this process
                                                  IterationLoop), rank pipeline,      ExternalExecutor: launcher ranks
                                                  deadline clock, lifecycle,          RayExecutor:      Ray actors
                                                  an Executor                         (actors/ray_executor.py)

The vocabulary is the seed's and vLLM's: the thing that runs a replica's ranks is an executor
(inline.py, external.py, and the Ray one in actors/). `Engine` and the dispatcher touch a replica
only through `Replica` (tests/test_replica_contract.py reads their source to hold them to it), so a
replica that schedules itself, with no queue or pipeline of ours, plugs in as any object with these
members (a backend returns it: backends.py).

An executor never calls up into the replica: the replica hands it a `ReplicaLink` (where replies
go, how to fail the replica) once, and calls it for everything else.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.ledger import Counts
from phyai_ray.work import Work


@runtime_checkable
class Replica(Protocol):
    """One whole model replica as the engine and the dispatcher see it (thread-safe)."""

    index: int
    world_size: int

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request: Any, *, caller_runs: bool = False, key: Any = None, size: int = 1,
               deadline: float | None = None, late: str = "finish") -> Future:
        """Queue `request`; raise EngineUnavailableError (failed) or EngineOverloadedError (full) at
        once, queueing nothing. `deadline`: the request's own (monotonic seconds); `late`: "drop"
        answers a result ready after it as missed."""

    def submit_stream(self, request: Any, max_buffered: int, deadline: float | None = None) -> tuple[Future, Any]:
        """Queue a streamed request: its future and a reader (`phyai_ray.streams.LocalReader`);
        `deadline`: its first chunk's (monotonic; see queues.RequestQueue.submit_stream)."""

    def collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout_s: float,
                       all_ranks: bool = False) -> Future:
        """Call `method` of the per-rank model on every rank; the output rank's reply (or all)."""

    # -- control (control.py) -------------------------------------------------------------------
    def control(self, op: str, args: tuple = (), *, timeout_s: float, mode: str = "wait") -> Any:
        """Run control call `op` on every rank (a `ControlReport`)."""

    def check_transition(self, op: str) -> None:
        """Raise ReplicaStateError / EngineUnavailableError when `op` is not allowed now."""

    def failed_report(self, op: str, error: BaseException, started: float) -> Any:
        """The `ControlReport` of a control call that failed on this replica."""

    # -- what routing and status read -----------------------------------------------------------
    def counts(self) -> Counts: ...

    def has_room(self) -> bool: ...

    def carry_counts(self, replaced: "Replica") -> None:
        """Continue the served / errored totals of the replica this one replaces."""

    def batch_stats(self) -> dict[str, Any]:
        """Histograms of batch sizes and queue waits (the engine's `batch_stats`)."""

    @property
    def max_queued(self) -> int | None: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def failure(self) -> EngineUnavailableError | None: ...

    @property
    def serving(self) -> bool: ...

    @property
    def state(self) -> Any:
        """A `ReplicaState` (control.py)."""

    @property
    def weight_version(self) -> Any: ...

    @property
    def pending_version(self) -> Any:
        """The version a weight update in progress installs (None outside one)."""

    @property
    def batching(self) -> bool:
        """Whether requests are batched per step."""

    @property
    def iterative(self) -> bool:
        """Whether requests run as sequences of the iteration loop (continuous batching)."""

    def unavailable_error(self) -> EngineUnavailableError: ...

    def nodes(self) -> tuple[str, ...]: ...

    def pids(self) -> tuple[int, ...]: ...

    def close(self) -> None:
        """Cancel queued work, fail unfinished work, release everything. Idempotent."""


@dataclass(frozen=True)
class ReplicaLink:
    """What an executor may call on its replica: where replies go and how a dead rank fails it.

    `deliver(work, value=None, error=None)` resolves a work's future, `finished(work)` frees its slot
    (every rank is done), `complete` is both at once (one rank); `fail(error)` is the replica's one
    failure path; `failure()` is None while the replica is healthy; `batching()` says whether requests
    are batched (an executor that runs steps itself then runs a lone step as a batch of one)."""

    deliver: Callable[..., None]
    finished: Callable[[Work], None]
    complete: Callable[..., None]
    fail: Callable[[EngineUnavailableError], None]
    failure: Callable[[], EngineUnavailableError | None]
    unavailable_error: Callable[[], EngineUnavailableError]
    batching: Callable[[], bool]


class Executor(Protocol):
    """What runs a `ScheduledReplica`'s ranks: one object per replica, called in one direction.

    Attributes: `name` ("inline", "torchrun", or the Ray lane: "ipc", "compiled", "actor_calls"),
    `world_size`, `batchable` / `iterative` (every rank's model has step_batch / the iteration
    protocol), `max_batch_weight` (None: unbounded), `runs_here` (a request may run on the caller's
    thread: one rank in this process), `lockstep` (every rank's engine must run the same requests in
    the same order, so nothing may depend on local timing: no batching, no skipping a late request).
    """

    name: str
    world_size: int
    batchable: bool
    iterative: bool
    max_batch_weight: int | None
    runs_here: bool
    lockstep: bool

    def bind(self, link: ReplicaLink) -> None:
        """Once, before any work: where replies go. An executor may start its health checks here."""

    def prepare(self, payload: Any) -> Any:
        """Serialize once, in the caller's thread, before a slot is taken (a bad payload loses nothing)."""

    def weight(self, prepared: Any) -> int:
        """What one prepared request costs against `max_batch_weight`."""

    def launch(self, work: Work) -> None:
        """Send dispatched `work` to every rank (dispatch order, one thread at a time)."""

    def run_here(self, work: Work) -> None:
        """Run `work` on the calling thread (only when `runs_here`)."""

    def step_here(self, request: Any) -> Any:
        """One plain step on the calling thread, its result or its exception (only when `runs_here`)."""

    def stream(self, request: Any, max_buffered: int) -> tuple[Any, Callable[[Any], Any]]:
        """(the payload of a streamed request, reader_for(future) -> its reader)."""

    def control(self, op: str, args: tuple, timeout_s: float) -> Future:
        """Run control op `op` on every rank's control lane; the future holds the replies in rank order."""

    def hang_detail(self, work: Work) -> tuple[int | None, str | None, str]:
        """(first rank that had not replied, its node, a phrase naming the ranks)."""

    def abandon(self) -> None:
        """After a failure: release the ranks without waiting for them (idempotent)."""

    def close(self, drain: bool) -> None:
        """Release the ranks; `drain`: let a running call finish first, bounded (idempotent)."""

    def nodes(self) -> tuple[str, ...]: ...

    def pids(self) -> tuple[int, ...]: ...


def rank_args(op: str, args: tuple, rank: int, world_size: int) -> tuple:
    """A control op's arguments for one rank (a transfer group needs each rank's place in it:
    group rank 0 is the trainer, so replica rank r is r + 1 of world_size + 1)."""
    if op == "init_weight_transfer":
        return (*args, rank + 1, world_size + 1)
    return args
