"""The one way phyai-ray joins or starts Ray: used by `Engine` (local and cluster modes), by
`phyai-ray serve` and by `run_server`.

    Ray already initialized in this process    -> use it (a Serve replica, a Ray job, a test)
    mode "cluster"                             -> join DeploymentConfig.address
    RAY_ADDRESS set                            -> join it
    a `ray start` instance on this machine     -> join it (Ray records it in /tmp/ray)
    otherwise                                  -> start a local instance sized to the plan

A local instance gets at least as many logical CPUs as the plan reserves
(ranks per replica x replicas x cpus_per_rank): rank actors are processes, and a small machine
may still host several CPU ranks (they then share its cores). So on a 2-core machine,
2 replicas x TP=2 start a 4-CPU Ray. A joined cluster is taken as it is; the plan's feasibility
check then says what is missing.

`import phyai_ray.raystart` does not import Ray; `ensure_ray` does.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def plan_cpus(engine_args: Any, deployment: Any) -> float:
    """Logical CPUs the plan reserves: ranks per replica x replicas x cpus_per_rank."""
    world = engine_args.config.parallel.infer_replica_world_size()
    return world * deployment.replica_count * deployment.cpus_per_rank


def ensure_ray(mode: str, deployment: Any, cpus_needed: float) -> bool:
    """Make this process a Ray driver (see the module docstring); True when it started Ray itself.

    Whoever gets True owns that instance and may `ray.shutdown()` it when done.
    """
    import ray

    if ray.is_initialized():
        return False
    kwargs = dict(deployment.ray_init_kwargs or {})
    address = _address(mode, deployment, kwargs.pop("address", None))
    if address is not None:
        logger.info("phyai-ray: joining Ray at %s", address)
        ray.init(address=address, **kwargs)
        return False
    kwargs.setdefault("num_cpus", max(os.cpu_count() or 1, int(cpus_needed + 0.999)))
    kwargs.setdefault("include_dashboard", False)
    logger.info("phyai-ray: starting a local Ray instance (%s)", kwargs)
    ray.init(address="local", **kwargs)
    return True


def _address(mode: str, deployment: Any, given: str | None) -> str | None:
    """Where to join, or None to start a local instance."""
    if given:
        return given
    if mode == "cluster":
        return deployment.address or "auto"
    return os.environ.get("RAY_ADDRESS") or _running_local_instance()


def _running_local_instance() -> str | None:
    """The address of a `ray start` instance on this machine, as `ray.init()` would find it; else None."""
    from ray._private.services import canonicalize_bootstrap_address  # what ray.init(address=None) calls

    try:
        return canonicalize_bootstrap_address(None)
    except Exception as exc:  # an unreadable record: start a fresh instance instead
        logger.debug("no running local Ray instance found (%s)", exc)
        return None
