"""Replica states and the control calls that move a replica between them (RL loops, operators).

    SERVING --pause--> PAUSED --resume--> SERVING
    SERVING | PAUSED --sleep(level)--> SLEEPING --wake_up(all tags)--> the state it slept from
    SERVING | PAUSED | SLEEPING --start_weight_update--> UPDATING --finish_weight_update--> back
    any --(a rank dies, a control call fails mid-way)--> FAILED

Only a SERVING replica dispatches requests; in every other state its requests keep queueing
within their deadlines (the dispatcher prefers SERVING replicas). Every control call first stops
dispatch and drains what is at the ranks (pause "keep" does not wait), then fans out to EVERY rank
of the replica over the control lane with a deadline. A control call that fails or times out on
any rank fails the replica: a half-updated replica never serves. An illegal transition raises
`ReplicaStateError` and changes nothing. Weight updates are all-or-nothing (`updates.py`: checks
before any weight changes, a lease, no waking without weights).

collective_rpc and control calls never overlap on a replica: an rpc arriving while a control call
runs waits for it (within the rpc's timeout), and a control call waits for the rpcs already at
the ranks (it drains them). An rpc is refused (`ReplicaStateError`) while the replica is UPDATING,
when its weights may be partly loaded; in SERVING, PAUSED and SLEEPING it reaches the ranks.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from phyai_ray.errors import EngineUnavailableError, ReplicaStateError, SleepUnsupportedError
from phyai_ray.executors.updates import DEFAULT_LEASE_S, WeightUpdates, _Update


class ReplicaState(str, enum.Enum):
    SERVING = "SERVING"
    PAUSED = "PAUSED"
    SLEEPING = "SLEEPING"
    UPDATING = "UPDATING"
    FAILED = "FAILED"


# op -> states it may start from (FAILED never: that raises EngineUnavailableError)
_ALLOWED = {
    "pause": {"SERVING", "PAUSED"},
    "resume": {"SERVING", "PAUSED"},
    "sleep": {"SERVING", "PAUSED", "SLEEPING"},
    "wake_up": {"SERVING", "PAUSED", "SLEEPING"},
    "reset_cache": {"SERVING", "PAUSED", "SLEEPING"},
    "init_weight_transfer": {"SERVING", "PAUSED", "SLEEPING"},
    "start_weight_update": {"SERVING", "PAUSED", "SLEEPING"},
    "update_weights": {"UPDATING"},
    "finish_weight_update": {"UPDATING"},
}
_HINTS = {
    "SLEEPING": "call wake_up() first",
    "UPDATING": "finish the weight update first (finish_weight_update)",
    "SERVING": "start_weight_update(version) first",
    "PAUSED": "start_weight_update(version) first",
}
ALL_TAGS = frozenset({"weights", "kv_cache"})


@dataclass(frozen=True)
class ControlReport:
    """What one control call did on one replica."""

    replica: int
    op: str
    state: str
    weight_version: Any
    ranks: tuple = ()  # each rank's reply, in rank order
    aborted: int = 0  # queued requests failed by pause(mode="abort")
    elapsed_s: float = 0.0
    error: str | None = None  # the call failed on this replica, which is now FAILED
    notes: tuple = ()  # update_weights / finish_weight_update: tensors accepted as other than sent (skipped, cast)

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class _Lifecycle:
    state: ReplicaState = ReplicaState.SERVING
    before: list[ReplicaState] = field(default_factory=list)  # states to return to (sleep, update)
    asleep: set[str] = field(default_factory=set)
    pending_version: Any = None
    transfer: Any = None  # the backend of init_weight_transfer
    update: _Update | None = None  # the weight update in progress (UPDATING)
    weights_dropped: bool = False  # slept at level 2; waking needs the weights refilled


class ReplicaControl:
    """The lifecycle of one replica: its state machine and control calls, a part the replica owns.

    Its collaborators are given, never reached for: the replica's rank `pipeline` (pipeline.py) and
    request `queue` (queues.py), `ranks(op, args, timeout_s) -> Future[list]` (run `op` on every rank's control
    lane: the executor's `control`), `fail(error)` (the replica's one failure path), `failure()`
    (None while healthy) and `unavailable_error()`. Weight updates are its `updates` part (updates.py).
    """

    def __init__(self, index: int, pipeline: Any, queue: Any, *, ranks: Callable[[str, tuple, float], Future],
                 fail: Callable[[EngineUnavailableError], None],
                 failure: Callable[[], EngineUnavailableError | None],
                 unavailable_error: Callable[[], EngineUnavailableError]) -> None:
        self.index, self.pipeline, self.queue = index, pipeline, queue
        self._control_ranks, self._fail, self._failure_of = ranks, fail, failure
        self.unavailable_error = unavailable_error
        self._life = _Lifecycle()
        self._control_lock = threading.Lock()  # one control call at a time per replica
        self.updates = WeightUpdates(index, self._life, fan_out=self._fan_out, fail=fail,
                                     restore_dispatch=self._restore_dispatch, failure=failure,
                                     weight_version=lambda: pipeline.weight_version, control_lock=self._control_lock)

    @property
    def failure(self) -> EngineUnavailableError | None:
        return self._failure_of()

    @property
    def pending_version(self) -> Any:
        """The version the weight update in progress installs (None outside one)."""
        return self._life.pending_version

    @property
    def state(self) -> ReplicaState:
        return ReplicaState.FAILED if self.failure is not None else self._life.state

    @property
    def weight_version(self) -> Any:
        return self.pipeline.weight_version

    @property
    def serving(self) -> bool:
        return self.state is ReplicaState.SERVING

    def control(self, op: str, args: tuple = (), *, timeout_s: float, mode: str = "wait") -> ControlReport:
        """Run control call `op` on this replica (see the module table); blocks up to `timeout_s`."""
        started = time.monotonic()
        deadline = started + timeout_s
        with self._exclusive(f"{op}()", timeout_s):
            self._check_transition(op)
            if op == "wake_up":
                self.updates.check_weights_loaded(args[0], deadline)
            aborted = self._quiesce(op, mode, deadline)
            if op == "update_weights":
                ranks = self.updates.update_weights(args[0], deadline)
            else:
                ranks = self._fan_out(op, args[:1] if op == "start_weight_update" else args, deadline)
            update = self._life.update
            notes = update.notes if update is not None and op in ("update_weights", "finish_weight_update") else ()
            self._after(op, args)
        return ControlReport(self.index, op, self.state.value, self.weight_version, tuple(ranks), aborted,
                             time.monotonic() - started, notes=notes)

    @contextlib.contextmanager
    def _exclusive(self, what: str, timeout_s: float) -> Iterator[None]:
        """Hold this replica's control lock: one control call (or rpc admission) at a time."""
        if not self._control_lock.acquire(timeout=max(timeout_s, 0.0)):
            raise TimeoutError(f"replica {self.index}: {what} waited {timeout_s:.1f}s for the control call running "
                               "on this replica to finish; nothing was changed (raise the timeout)")
        try:
            yield
        finally:
            self._control_lock.release()

    @contextlib.contextmanager
    def rpc_admission(self, timeout_s: float) -> Iterator[None]:
        """Admit a collective_rpc: never beside a running control call, never while UPDATING."""
        with self._exclusive("collective_rpc", timeout_s):
            if self.failure is not None:
                raise self.unavailable_error()
            if self._life.state is ReplicaState.UPDATING:
                raise ReplicaStateError(
                    f"replica {self.index} is UPDATING: collective_rpc is refused while a weight update (to version "
                    f"{self._life.pending_version!r}) may have loaded part of the weights; call it after "
                    "finish_weight_update(), or before start_weight_update()", replica=self.index,
                    state="UPDATING", op="collective_rpc")
            yield

    def failed_report(self, op: str, error: BaseException, started: float) -> ControlReport:
        return ControlReport(self.index, op, self.state.value, self.weight_version, (), 0,
                             time.monotonic() - started, f"{type(error).__name__}: {error}")

    def check_transition(self, op: str) -> None:
        """Raise ReplicaStateError (or EngineUnavailableError) when `op` is not allowed now."""
        self._check_transition(op)

    def _check_transition(self, op: str) -> None:
        if self.failure is not None:
            raise self.unavailable_error()
        state = self._life.state.value
        if state not in _ALLOWED[op]:
            raise ReplicaStateError(
                f"replica {self.index} is {state}: {op}() is allowed only from {sorted(_ALLOWED[op])}; "
                f"{_HINTS.get(state, 'check replica_status()')}", replica=self.index, state=state, op=op)
        if op == "finish_weight_update":
            self.updates.check_complete()

    def _quiesce(self, op: str, mode: str, deadline: float) -> int:
        """Stop dispatch and drain the ranks as `op` needs; returns how many queued requests were aborted."""
        if op == "resume":
            return 0
        aborted = self.queue.quiesce(op, mode, deadline)  # first: no iteration starts once the pipeline holds
        self.pipeline.hold()  # (a step queue held it already, before it aborted its queued requests)
        if op == "pause" and mode == "keep":
            return aborted
        if not self.pipeline.drain(max(deadline - time.monotonic(), 0.0)):
            self._restore_dispatch()
            raise TimeoutError(f"replica {self.index}: {op}() waited for the requests at its ranks to finish "
                               "and ran out of time; nothing was changed (raise the timeout)")
        return aborted

    def _fan_out(self, op: str, args: tuple, deadline: float) -> list:
        future: Future = self._control_ranks(op, args, max(deadline - time.monotonic(), 0.01))
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.01) + 1.0)
        except EngineUnavailableError:
            raise
        except SleepUnsupportedError:  # every rank refused before freeing anything: the replica is as it was
            self._restore_dispatch()
            raise
        except BaseException as exc:  # a rank failed or timed out mid-call: its state is unknown
            error = EngineUnavailableError(
                f"replica {self.index}: control call {op}() failed on a rank ({type(exc).__name__}: {exc}); the "
                "replica may be half-changed, so it was stopped and will not serve",
                reason="timeout" if isinstance(exc, TimeoutError) else "exception", replica=self.index)
            error.__cause__ = exc
            self._fail(error)
            raise error from exc

    def _after(self, op: str, args: tuple) -> None:
        life = self._life
        if op == "pause":
            life.state = ReplicaState.PAUSED
        elif op == "resume":
            life.state = ReplicaState.SERVING
        elif op == "sleep":
            if life.state is not ReplicaState.SLEEPING:
                life.before.append(life.state)
            life.state, life.asleep = ReplicaState.SLEEPING, set(ALL_TAGS)
            life.weights_dropped = life.weights_dropped or args[0] == 2
        elif op == "wake_up":
            life.asleep -= set(args[0] or ALL_TAGS)
            if life.state is ReplicaState.SLEEPING and not life.asleep:
                life.state = life.before.pop()
        elif op == "init_weight_transfer":
            life.transfer = args[0]
        elif op == "start_weight_update":
            life.before.append(life.state)
            life.state, life.pending_version = ReplicaState.UPDATING, args[0]
            self.updates.start_lease(args[0], args[1] if len(args) > 1 and args[1] is not None else DEFAULT_LEASE_S)
        elif op == "update_weights":
            self.updates.renew_lease()
        elif op == "finish_weight_update":
            self.pipeline.weight_version = life.pending_version
            self.updates.end_update()
        self._restore_dispatch()

    def _restore_dispatch(self) -> None:
        if self._life.state is ReplicaState.SERVING and self.failure is None:
            self.pipeline.release()
            self.queue.release(self.pipeline.weight_version)
