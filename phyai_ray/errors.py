"""The exception hierarchy of phyai-ray.

Every error derives from `PhyAIError` and mixes in the builtin it behaves
like, so callers may catch either:

    PhyAIError
    ├── ParallelConfigError(ValueError)   topology rejected by config or plugin
    ├── DeploymentConfigError(ValueError) deployment settings that cannot work
    ├── PluginError(LookupError)          a plugin name or import path that does not resolve
    ├── StartupError(RuntimeError)        workers failed or timed out while starting
    └── EngineUnavailableError(RuntimeError)
                                          the backend can no longer serve
"""

from __future__ import annotations

from typing import Any


class PhyAIError(Exception):
    """Base class of every phyai-ray error."""


class ParallelConfigError(PhyAIError, ValueError):
    """A parallel topology is invalid, or a plugin cannot run it."""


class DeploymentConfigError(PhyAIError, ValueError):
    """Deployment settings (mode, devices, replicas, ports) that cannot work."""


class PluginError(PhyAIError, LookupError):
    """A plugin could not be found or loaded."""


class StartupError(PhyAIError, RuntimeError):
    """A replica failed to start; nothing of it is left running."""

    def __init__(self, message: str, *, replica: int | None = None, rank: int | None = None,
                 node: str | None = None) -> None:
        super().__init__(message)
        self.replica, self.rank, self.node = replica, rank, node


class EngineUnavailableError(PhyAIError, RuntimeError):
    """The backend can no longer serve: a worker died, a deadline passed, or it was closed.

    Attributes name the cause so an owning layer (Ray Serve, an RL loop) can act on it:
    `reason` is one of "closed", "worker_exit", "timeout", "exception", "malformed",
    "no_healthy_replica"; `replica`, `rank` and `node` are filled when known.
    """

    def __init__(self, message: str, *, reason: str = "unavailable", replica: int | None = None,
                 rank: int | None = None, node: str | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.reason, self.replica, self.rank, self.node, self.detail = reason, replica, rank, node, detail

    def __reduce__(self):  # keep attributes across pickling (Ray, multiprocessing)
        return (_rebuild_unavailable, (str(self), self.reason, self.replica, self.rank, self.node, self.detail))


def _rebuild_unavailable(message, reason, replica, rank, node, detail) -> EngineUnavailableError:
    return EngineUnavailableError(message, reason=reason, replica=replica, rank=rank, node=node, detail=detail)
