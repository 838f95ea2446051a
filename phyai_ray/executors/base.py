"""The contract every replica executor keeps, and the status the engine reports per replica."""

from __future__ import annotations

import abc
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from phyai_ray.errors import EngineUnavailableError


@dataclass(frozen=True)
class ReplicaStatus:
    """What the engine knows about one replica; never waits behind a running step."""

    index: int
    healthy: bool
    world_size: int
    in_flight: int
    served: int
    errored: int
    failure: str | None = None
    failure_reason: str | None = None
    failed_rank: int | None = None
    nodes: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ReplicaExecutor(abc.ABC):
    """One WHOLE model replica (one rank or many). Requests run in submission order."""

    def __init__(self, index: int, world_size: int) -> None:
        self.index, self.world_size = index, world_size
        self._failure: EngineUnavailableError | None = None
        self._failure_lock = threading.Lock()

    @abc.abstractmethod
    def submit(self, request: Any) -> Future:
        """Queue `request` on every rank; the future resolves to the output rank's result."""

    @abc.abstractmethod
    def collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout_s: float,
                       all_ranks: bool = False) -> Future:
        """Call `method` of the per-rank model on every rank, in request order."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fail unfinished work with EngineUnavailableError and release everything. Idempotent."""

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

    def unavailable_error(self) -> EngineUnavailableError:
        """The error to raise for work sent to a failed replica."""
        cause = self._failure
        error = EngineUnavailableError(f"replica {self.index} is unavailable: {cause}", reason=cause.reason,
                                       replica=self.index, rank=cause.rank, node=cause.node, detail=cause.detail)
        error.__cause__ = cause
        return error


def fail_future(future: Future, error: BaseException) -> None:
    """Set `error` on `future` unless it already finished (safe against races with the worker)."""
    if future.done():
        return
    try:
        future.set_exception(error)
    except Exception:  # InvalidStateError: finished concurrently
        pass


def resolve_future(future: Future, value: Any) -> None:
    """Set `value` on `future` unless it already finished."""
    if future.done():
        return
    try:
        future.set_result(value)
    except Exception:
        pass
