"""Replica executors and the factory that picks them by mode (Ray is imported only when chosen:
the Ray backend registers itself, see backends.py)."""

from __future__ import annotations

from typing import Any

from phyai_ray.executors.backends import backend
from phyai_ray.executors.base import ReplicaExecutor, ReplicaStatus


def create_executors(mode: str, entry: Any, args: Any, deployment: Any) -> list[ReplicaExecutor]:
    """Start every replica of `mode`; on failure nothing started is left behind."""
    parallel, device, proc = args.config.parallel, args.config.device, deployment.process_config
    if mode == "inline":
        from phyai_ray.executors.inline import InlineExecutor, build_inline_runner

        return [InlineExecutor(lambda: build_inline_runner(entry, args.plugin_args, parallel, device),
                               execution_timeout_s=proc.execution_timeout_s,
                               startup_timeout_s=proc.startup_timeout_s, shutdown_timeout_s=proc.shutdown_timeout_s,
                               max_queued=proc.max_queued_requests, batching=deployment.batching)]
    if mode == "external":
        from phyai_ray.executors.external import ExternalExecutor

        return [ExternalExecutor(entry, args.plugin_args, parallel, device,
                                 execution_timeout_s=proc.execution_timeout_s,
                                 startup_timeout_s=proc.startup_timeout_s, shutdown_timeout_s=proc.shutdown_timeout_s,
                                 collective_timeout_s=proc.collective_timeout_s)]
    return backend(mode).start(mode, entry, args, deployment)


def restart_executor(index: int, mode: str, entry: Any, args: Any, deployment: Any) -> ReplicaExecutor:
    """A fresh replica `index` on the plan it had (the Ray modes: local, cluster)."""
    restart = backend(mode).restart
    if restart is None:
        raise ValueError(f"deployment mode {mode!r} cannot restart a replica in place")
    return restart(index, mode, entry, args, deployment)


__all__ = ["ReplicaExecutor", "ReplicaStatus", "create_executors", "restart_executor"]
