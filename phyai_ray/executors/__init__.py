"""Replicas, the executors that run their ranks, and the factory that starts them by mode (backends.py: Ray
is imported only when chosen)."""

from __future__ import annotations

from typing import Any

from phyai_ray.executors.backends import backend
from phyai_ray.executors.base import ReplicaStatus, ScheduledReplica
from phyai_ray.executors.replica import Executor, Replica


def create_replicas(mode: str, entry: Any, args: Any, deployment: Any) -> list[Replica]:
    """Start every replica of `mode`; on failure nothing started is left behind."""
    return backend(mode).start(mode, entry, args, deployment)


def restart_replica(index: int, mode: str, entry: Any, args: Any, deployment: Any) -> Replica:
    """A fresh replica `index` on the plan it had (the Ray modes: local, cluster)."""
    restart = backend(mode).restart
    if restart is None:
        raise ValueError(f"deployment mode {mode!r} cannot restart a replica in place")
    return restart(index, mode, entry, args, deployment)


__all__ = ["Executor", "Replica", "ReplicaStatus", "ScheduledReplica", "create_replicas", "restart_replica"]
