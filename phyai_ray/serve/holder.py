"""`EngineHolder`: the engine an ingress replica owns, its health verdict, and in-place rebuilds.

The engine never restarts workers itself (a failed replica group stays failed). The holder is
the owning layer the design asks for:

* `check_health()` (Serve calls it every `health_check_period_s`) raises while no replica group
  can serve, so Serve marks the ingress unhealthy and replaces it, engine and all.
* With `rebuild_failed=True` it instead closes the dead engine and builds a new one on a
  background thread (requests meanwhile get 503); only a rebuild that fails makes it unhealthy.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from phyai_ray.errors import EngineUnavailableError

logger = logging.getLogger(__name__)


class EngineHolder:
    """Owns one `Engine` (built by `build`), replaceable when every replica group has failed."""

    def __init__(self, build: Callable[[], Any], *, rebuild_failed: bool = False,
                 on_rebuild: Callable[[], None] | None = None) -> None:
        self._build, self.rebuild_failed, self.on_rebuild = build, rebuild_failed, on_rebuild
        self._engine = build()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._rebuild_error: BaseException | None = None
        self._closed = False
        self.rebuilds = 0

    @property
    def engine(self) -> Any:
        """The current engine (a closed one while a rebuild runs)."""
        return self._engine

    @property
    def rebuilding(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check_health(self) -> None:
        """Return when some replica group can serve (or a rebuild is under way); raise otherwise."""
        if self._closed:
            raise EngineUnavailableError("the ingress is shutting down", reason="closed")
        if self._engine.healthy:
            return
        if not self.rebuild_failed:
            raise EngineUnavailableError(f"no replica group can serve: {self.failures()}; the ingress reports "
                                         "unhealthy so that Serve replaces it", reason="no_healthy_replica")
        with self._lock:
            if self._rebuild_error is not None:
                raise EngineUnavailableError(f"rebuilding the engine failed: {self._rebuild_error}",
                                             reason="no_healthy_replica") from self._rebuild_error
            if not self.rebuilding:
                logger.warning("no replica group can serve (%s); rebuilding the engine in place", self.failures())
                self._thread = threading.Thread(target=self._rebuild, name="phyai-engine-rebuild", daemon=True)
                self._thread.start()

    def failures(self) -> str:
        """`replica 0: <cause>; replica 1: <cause>` for the replicas that failed."""
        causes = [f"replica {s.index}: {s.failure}" for s in self._engine.replica_status() if not s.healthy]
        return "; ".join(causes) or "the engine is closed"

    def _rebuild(self) -> None:
        self._engine.close()  # frees the devices and placement groups the new engine needs
        try:
            engine = self._build()
        except BaseException as exc:
            logger.exception("rebuilding the engine failed")
            self._rebuild_error = exc
            return
        with self._lock:
            if self._closed:
                engine.close()
                return
            self._engine, self.rebuilds = engine, self.rebuilds + 1
        logger.info("engine rebuilt (%d rebuild(s) so far)", self.rebuilds)
        if self.on_rebuild is not None:
            self.on_rebuild()

    def close(self, timeout_s: float = 30.0) -> None:
        """Close the engine (and one a running rebuild produces). Idempotent."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._engine.close()
        if thread is not None:
            thread.join(timeout_s)
