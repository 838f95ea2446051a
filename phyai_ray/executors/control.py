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
`ReplicaStateError` and changes nothing.
"""

from __future__ import annotations

import enum
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from phyai_ray.errors import EngineUnavailableError, ReplicaStateError, RequestAbortedError


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

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class _Lifecycle:
    state: ReplicaState = ReplicaState.SERVING
    before: list[ReplicaState] = field(default_factory=list)  # states to return to (sleep, update)
    asleep: set[str] = field(default_factory=set)
    pending_version: Any = None
    transfer: Any = None  # the backend of init_weight_transfer


class ReplicaControl:
    """The state machine of one replica executor; mixed into `ReplicaExecutor`.

    The executor provides `scheduler`, `index`, `world_size`, `_fail(error)`, `failure` and
    `_control_ranks(op, args, timeout_s) -> Future[list]` (run `op` on every rank's control lane).
    """

    def _init_control(self) -> None:
        self._life = _Lifecycle()
        self._control_lock = threading.Lock()  # one control call at a time per replica

    @property
    def state(self) -> ReplicaState:
        return ReplicaState.FAILED if self.failure is not None else self._life.state

    @property
    def weight_version(self) -> Any:
        return self.scheduler.weight_version

    @property
    def serving(self) -> bool:
        return self.state is ReplicaState.SERVING

    def control(self, op: str, args: tuple = (), *, timeout_s: float, mode: str = "wait") -> ControlReport:
        """Run control call `op` on this replica (see the module table); blocks up to `timeout_s`."""
        started = time.monotonic()
        with self._control_lock:
            self._check_transition(op)
            aborted = self._quiesce(op, mode, started + timeout_s)
            ranks = self._fan_out(op, args, started + timeout_s)
            self._after(op, args)
        return ControlReport(self.index, op, self.state.value, self.weight_version, tuple(ranks), aborted,
                             time.monotonic() - started)

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

    def _quiesce(self, op: str, mode: str, deadline: float) -> int:
        """Stop dispatch and drain the ranks as `op` needs; returns how many queued requests were aborted."""
        if op == "resume":
            return 0
        self.scheduler.hold()
        aborted = 0
        if op == "pause" and mode == "abort":
            aborted = self.scheduler.abort_queued(lambda: RequestAbortedError(
                f"replica {self.index} was paused with mode='abort'; the request was dropped before it reached "
                "a rank: submit it again after resume()", replica=self.index))
        if op == "pause" and mode == "keep":
            return aborted
        if not self.scheduler.drain(max(deadline - time.monotonic(), 0.0)):
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
        elif op == "wake_up":
            life.asleep -= set(args[0] or ALL_TAGS)
            if life.state is ReplicaState.SLEEPING and not life.asleep:
                life.state = life.before.pop()
        elif op == "init_weight_transfer":
            life.transfer = args[0]
        elif op == "start_weight_update":
            life.before.append(life.state)
            life.state, life.pending_version = ReplicaState.UPDATING, args[0]
        elif op == "finish_weight_update":
            self.scheduler.weight_version = life.pending_version
            life.state = life.before.pop()
        self._restore_dispatch()

    def _restore_dispatch(self) -> None:
        if self._life.state is ReplicaState.SERVING and self.failure is None:
            self.scheduler.release()
