"""`EngineHolder`: the engine a group's Serve replica owns, its health verdict, and in-place restarts.

The engine never restarts workers itself (a failed replica group stays failed). The holder is
the owning layer the design asks for:

* `check_health()` (Serve calls it every `health_check_period_s`) raises while no replica group
  can serve (in the Serve app: while its one group has failed), so Serve replaces that replica.
* With `rebuild_failed=True` it instead restarts each failed replica group in place
  (`Engine.restart_replica`) on a background thread, while the healthy groups keep serving;
  requests get 503 only while no group is up. Only a restart that fails makes it unhealthy.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from phyai_ray.errors import EngineUnavailableError

logger = logging.getLogger(__name__)


class EngineHolder:
    """Owns one `Engine` (built by `build`) and, if asked, restarts its failed replica groups."""

    def __init__(self, build: Callable[[], Any], *, rebuild_failed: bool = False,
                 on_rebuild: Callable[[], None] | None = None) -> None:
        self.rebuild_failed, self.on_rebuild = rebuild_failed, on_rebuild
        self._engine = build()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._restart_error: BaseException | None = None
        self._closed = False
        self.rebuilds = 0

    @property
    def engine(self) -> Any:
        return self._engine

    @property
    def rebuilding(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check_health(self) -> None:
        """Return when some replica group can serve (or a restart is under way); raise otherwise."""
        if self._closed:
            raise EngineUnavailableError("the ingress is shutting down", reason="closed")
        if self.rebuild_failed:
            self._restart_failed_groups()
        if self._engine.healthy or self.rebuilding:
            return
        if self._restart_error is not None:
            raise EngineUnavailableError(f"restarting a failed replica group failed: {self._restart_error}",
                                         reason="no_healthy_replica") from self._restart_error
        raise EngineUnavailableError(f"no replica group can serve: {self.failures()}; the ingress reports "
                                     "unhealthy so that Serve replaces it", reason="no_healthy_replica")

    def failures(self) -> str:
        """`replica 0: <cause>; replica 1: <cause>` for the replica groups that failed."""
        causes = [f"replica {s.index}: {s.failure}" for s in self._engine.replica_status() if not s.healthy]
        return "; ".join(causes) or "the engine is closed"

    def _restart_failed_groups(self) -> None:
        failed = [s.index for s in self._engine.replica_status() if not s.healthy]
        with self._lock:
            if not failed or self.rebuilding or self._restart_error is not None or self._closed:
                return
            logger.warning("replica group(s) %s failed (%s); restarting them in place", failed, self.failures())
            self._thread = threading.Thread(target=self._restart, args=(failed,), name="phyai-group-restart",
                                            daemon=True)
            self._thread.start()

    def _restart(self, indices: list[int]) -> None:
        for index in indices:
            if self._closed:
                return
            try:
                self._engine.restart_replica(index)
            except BaseException as exc:
                logger.exception("restarting replica group %d failed", index)
                self._restart_error = exc
                return
            self.rebuilds += 1
            logger.info("replica group %d restarted (%d restart(s) so far)", index, self.rebuilds)
            if self.on_rebuild is not None:
                self.on_rebuild()

    def close(self, timeout_s: float = 30.0) -> None:
        """Close the engine; a running restart notices and stops. Idempotent."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._engine.close()
        if thread is not None:
            thread.join(timeout_s)
