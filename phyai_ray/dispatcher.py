"""`RequestDispatcher`: sends each whole request to ONE healthy replica.

Choice: the healthy replica with the fewest in-flight requests; ties go to the replica chosen
least recently (so idle replicas take turns). In-flight counts drop when a request's future
finishes for any reason: result, exception, cancellation or close. A replica that refuses a
request before starting it (it just failed) is skipped and the next one is tried; a started
request is never retried.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Sequence

from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.base import ReplicaExecutor


class RequestDispatcher:
    """Least-in-flight routing over replica executors, with exact accounting."""

    def __init__(self, executors: Sequence[ReplicaExecutor]) -> None:
        if not executors:
            raise ValueError("a dispatcher needs at least one replica executor")
        self.executors = list(executors)
        n = len(self.executors)
        self._lock = threading.Lock()
        self._in_flight, self._served, self._errored = [0] * n, [0] * n, [0] * n
        self._last_chosen, self._tick = [-1] * n, 0

    def submit(self, request: Any) -> Future:
        """Route `request`; raises EngineUnavailableError at once when no replica is healthy."""
        refused: set[int] = set()
        while True:
            index = self._choose(refused)
            try:
                future = self.executors[index].submit(request)
            except EngineUnavailableError:
                self._finish(index, ok=None)
                refused.add(index)
                continue
            except BaseException:
                self._finish(index, ok=None)
                raise
            future.add_done_callback(lambda f, i=index: self._finish(i, ok=_succeeded(f)))
            return future

    def _choose(self, refused: set[int]) -> int:
        with self._lock:
            healthy = [i for i, e in enumerate(self.executors) if e.healthy and i not in refused]
            if not healthy:
                raise self._no_replica_error()
            index = min(healthy, key=lambda i: (self._in_flight[i], self._last_chosen[i]))
            self._in_flight[index] += 1
            self._last_chosen[index], self._tick = self._tick, self._tick + 1
            return index

    def _finish(self, index: int, ok: bool | None) -> None:
        with self._lock:
            self._in_flight[index] -= 1
            if ok is True:
                self._served[index] += 1
            elif ok is False:
                self._errored[index] += 1

    def replace(self, index: int, executor: ReplicaExecutor) -> None:
        """Route to `executor` from now on in place of replica `index` (its counters carry on)."""
        with self._lock:
            self.executors[index] = executor

    def counts(self, index: int) -> tuple[int, int, int]:
        """(in_flight, served, errored) of one replica."""
        with self._lock:
            return self._in_flight[index], self._served[index], self._errored[index]

    def _no_replica_error(self) -> EngineUnavailableError:
        causes = "; ".join(f"replica {e.index}: {e.failure}" for e in self.executors if e.failure is not None)
        return EngineUnavailableError(
            f"no healthy replica among {len(self.executors)}: {causes or 'all refused the request'}",
            reason="no_healthy_replica")


def _succeeded(future: Future) -> bool | None:
    if future.cancelled():
        return None
    return future.exception() is None
