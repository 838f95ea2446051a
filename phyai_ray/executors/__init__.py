"""Replica executors and the factory that picks them by mode (Ray is imported only when chosen)."""

from __future__ import annotations

from typing import Any

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
    if mode in ("local", "cluster"):
        from actors.launch import start_replicas  # the one place phyai_ray reaches into `actors`

        return start_replicas(mode, entry, args, deployment)
    raise ValueError(f"unknown deployment mode {mode!r}")


def restart_executor(index: int, mode: str, entry: Any, args: Any, deployment: Any) -> ReplicaExecutor:
    """A fresh Ray replica group `index` on the plan it had (local/cluster modes)."""
    from actors.launch import start_replica

    return start_replica(index, mode, entry, args, deployment)


__all__ = ["ReplicaExecutor", "ReplicaStatus", "create_executors", "restart_executor"]
