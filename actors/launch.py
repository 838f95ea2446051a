"""Start every replica of a local or cluster engine; a failed start leaves nothing behind."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from actors.placement_groups import alive_nodes, node_targets
from actors.ray_executor import RayExecutor
from actors.startup import ensure_ray
from phyai_ray.errors import DeploymentConfigError
from phyai_ray.executors.base import ScheduledReplica
from placement.bundles import describe_plan, plan_replicas
from placement.spread import check_feasible

logger = logging.getLogger(__name__)


def resolve_device_type(device_config: Any) -> str:
    """cpu or cuda; `auto` asks the Ray cluster whether it has GPUs."""
    return device_config.resolve_target(cuda_available=ray.cluster_resources().get("GPU", 0) > 0)


def _plan(mode: str, args: Any, deployment: Any) -> tuple[str, list, list]:
    """Device type, replica plans and preferred nodes; an impossible local plan fails here."""
    world = args.config.parallel.infer_replica_world_size()
    ensure_ray(mode, deployment, cpus_needed=world * deployment.replica_count * deployment.cpus_per_rank)
    device_type = resolve_device_type(args.config.device)
    if device_type == "cpu" and deployment.devices is not None:
        raise DeploymentConfigError(f"devices={deployment.devices} names GPUs but the device target is cpu; "
                                    "drop devices or use DeviceConfig(target='cuda')")
    plans = plan_replicas(ranks_per_replica=world,
                          replica_count=deployment.replica_count, use_gpu=device_type == "cuda",
                          cpus_per_rank=deployment.cpus_per_rank, strategy=deployment.placement_strategy,
                          devices=deployment.devices)
    if deployment.placement is not None:  # the owner's placement groups: nothing to plan or check here
        return device_type, plans, [None] * len(plans)
    if mode == "local":  # no autoscaler will add nodes: an impossible plan fails now, not at the deadline
        try:
            check_feasible(plans, alive_nodes())
        except ValueError as exc:
            raise DeploymentConfigError(f"{mode} mode: {exc}") from None
    return device_type, plans, node_targets(plans, deployment.spread_replicas)


def _replica(plan: Any, *, entry: Any, args: Any, deployment: Any, device_type: str, target_node: str | None,
             deadline: float) -> ScheduledReplica:
    """One replica: its Ray executor (ranks started), then the ScheduledReplica around it (queue, rank
    pipeline, clock, lifecycle)."""
    executor = RayExecutor(plan, entry=entry, args=args, deployment=deployment, device_type=device_type,
                           target_node=target_node, deadline=deadline)
    proc = deployment.process_config
    try:
        return ScheduledReplica(executor, index=plan.index, max_ongoing=proc.max_ongoing_requests,
                                max_queued=proc.max_queued_requests, step_limit_s=proc.step_limit_s,
                                hang_limit_s=proc.hang_limit_s, cap_s=proc.execution_timeout_s,
                                batching=deployment.batching, entry=entry)
    except BaseException:
        executor.close(drain=False)
        raise


def start_replicas(mode: str, entry: Any, args: Any, deployment: Any) -> list[ScheduledReplica]:
    """Plan, place and start all replicas concurrently, with one startup deadline."""
    device_type, plans, targets = _plan(mode, args, deployment)
    logger.info("phyai-ray placement (%s, %s):\n%s", mode, device_type, describe_plan(plans))
    deadline = time.monotonic() + deployment.process_config.startup_timeout_s
    with ThreadPoolExecutor(max_workers=len(plans), thread_name_prefix="phyai-start") as pool:
        futures = [pool.submit(_replica, plan, entry=entry, args=args, deployment=deployment,
                               device_type=device_type, target_node=target, deadline=deadline)
                   for plan, target in zip(plans, targets)]
    started, errors = [], []
    for future in futures:
        try:
            started.append(future.result())
        except BaseException as exc:
            errors.append(exc)
    if errors:
        for replica in started:
            replica.close()
        raise errors[0]
    return started


def start_replica(index: int, mode: str, entry: Any, args: Any, deployment: Any) -> ScheduledReplica:
    """Start replica `index` alone, with the plan it had (used to replace a failed group)."""
    device_type, plans, targets = _plan(mode, args, deployment)
    deadline = time.monotonic() + deployment.process_config.startup_timeout_s
    return _replica(plans[index], entry=entry, args=args, deployment=deployment, device_type=device_type,
                    target_node=targets[index], deadline=deadline)


def register() -> None:
    """The `phyai_ray.backends` entry point: the `ray` backend (replica groups; the modes local and cluster)."""
    from phyai_ray.executors.backends import Backend, register_backend

    register_backend("ray", Backend(start=start_replicas, restart=start_replica))
