"""The Ray Serve application: the `ReplicaGroup` deployment (each Serve replica is one replica group)
and the small `GroupRegistry` beside it.

Three ways to start it:

    serve run phyai_ray.serve:build_app plugin=reference_dit dense_tp_size=2 replicas=2 device=cpu
    serve run config.yaml          # applications: [{import_path: phyai_ray.serve:build_app, args: {...}}]
    serve.run(create_app(EngineArgs(plugin="reference_dit"), DeploymentConfig.local(replica_count=2)))

`replicas` (DeploymentConfig.replica_count) is the number of groups, fixed; with `min_replicas` /
`max_replicas` / `target_ongoing_requests` (ServeOptions) Serve autoscales whole groups instead.
Requests are routed by `FewestInFlightRouter`. A group's Serve replica is its HTTP edge too (the
proxy sends each request straight to a group: one hop); see the README for the measurement that
chose this over a separate gateway deployment.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ray import serve
from ray.serve import Application

from phyai_ray.config.deployment import DeploymentConfig
from phyai_ray.config.engine import EngineArgs
from phyai_ray.errors import DeploymentConfigError
from phyai_ray.serve.runtime.options import ServeOptions, parse_app_args

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "ReplicaGroup"
REGISTRY_NAME = "GroupRegistry"
# How often a stopping Serve replica looks whether its last request has finished (Serve's default is 2 s,
# slept before the first look, so every scale-down, replacement and `serve.delete` took 2 s or more
# even with nothing in flight). A look is one counter read.
DRAIN_POLL_S = 0.2


def check_servable(engine_args: EngineArgs, deployment: DeploymentConfig) -> None:
    """Settings that have no meaning when Serve places the groups fail here, before anything starts."""
    deployment.resolve_mode(engine_args.config.parallel.infer_replica_world_size())
    if deployment.mode == "external":
        raise DeploymentConfigError("mode='external' ranks are started by torchrun, not by Serve; serve them with "
                                    "mode='auto', 'local' or 'cluster'")
    if deployment.devices is not None or deployment.placement is not None:
        raise DeploymentConfigError("devices=... and placement=... pin ranks, but in the Serve app each group's "
                                    "Serve replica reserves its own placement group; leave them unset (Ray assigns "
                                    "GPUs per bundle)")


def group_options(engine_args: EngineArgs, deployment: DeploymentConfig, options: ServeOptions) -> dict[str, Any]:
    """`serve.deployment(...)` options of the group deployment: resources, scaling, health, routing."""
    from ray.serve.config import RequestRouterConfig

    from phyai_ray.serve.runtime.router import FewestInFlightRouter
    from phyai_ray.serve.runtime.runner import FORWARD_WAIT_S
    from placement.bundles import rank_bundle

    world = engine_args.config.parallel.infer_replica_world_size()
    bundle = rank_bundle(_uses_gpu(engine_args), deployment.cpus_per_rank)
    actor: dict[str, Any] = {"runtime_env": deployment.runtime_env} if deployment.runtime_env else {}
    out: dict[str, Any] = dict(
        max_ongoing_requests=options.max_ongoing_requests, max_queued_requests=options.max_queued_requests,
        health_check_period_s=options.health_check_period_s, health_check_timeout_s=options.health_check_timeout_s,
        # a stopping group drains first: a request it forwards may wait FORWARD_WAIT_S for a new group
        graceful_shutdown_timeout_s=max(deployment.process_config.shutdown_timeout_s, FORWARD_WAIT_S) + 10,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        request_router_config=RequestRouterConfig(request_router_class=FewestInFlightRouter,
                                                  request_routing_stats_period_s=min(options.health_check_period_s,
                                                                                     2.0)))
    if world == 1:  # the rank runs inline in the Serve replica, which reserves its resources
        out["ray_actor_options"] = {**actor, "num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0.0)}
    else:  # the Serve replica (no CPU) sits in bundle 0 beside rank 0; rank r runs in bundle r
        out["ray_actor_options"] = {**actor, "num_cpus": 0}
        out["placement_group_bundles"] = [dict(bundle) for _ in range(world)]
        out["placement_group_strategy"] = deployment.placement_strategy
    if options.autoscaling is not None:
        out["autoscaling_config"] = options.autoscaling
    else:
        out["num_replicas"] = deployment.replica_count
    return out


def _uses_gpu(engine_args: EngineArgs) -> bool:
    import ray

    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    return engine_args.config.device.resolve_target(cuda_available=gpus > 0) == "cuda"


def create_app(engine_args: EngineArgs, deployment: DeploymentConfig | None = None,
               options: ServeOptions | None = None, **option_values: Any) -> Application:
    """A bound Serve application: `serve.run(create_app(args, DeploymentConfig.local(replica_count=2)))`.

    `option_values` are `ServeOptions` fields (api_key=..., min_replicas=..., max_replicas=...).
    """
    from phyai_ray.serve.runtime.group import ReplicaGroup
    from phyai_ray.serve.runtime.registry import GroupRegistry

    options = ServeOptions(**{**(options.model_dump() if options else {}), **option_values})
    deployment = deployment or DeploymentConfig()
    check_servable(engine_args, deployment)
    registry = serve.deployment(GroupRegistry, name=REGISTRY_NAME, num_replicas=1, max_ongoing_requests=1000,
                                graceful_shutdown_wait_loop_s=DRAIN_POLL_S, ray_actor_options={"num_cpus": 0}).bind()
    groups = serve.deployment(ReplicaGroup, name=DEPLOYMENT_NAME,
                              **group_options(engine_args, deployment, options))
    return groups.bind(engine_args, deployment, options, registry)


def group_handle(app_name: str = "phyai") -> Any:
    """The `DeploymentHandle` of an app's groups, from anywhere in the cluster (tasks, actors, other apps):

        result = await group_handle("phyai").step.remote(request)
    """
    return serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name)


def build_app(args: Mapping[str, Any]) -> Application:
    """The builder `serve run phyai_ray.serve:build_app key=value ...` and config files name."""
    engine_args, deployment, options = parse_app_args(args)
    scaling = options.autoscaling or {"replicas": deployment.replica_count}
    logger.info("phyai-ray serve app: plugin=%s %s groups: %s", engine_args.plugin,
                engine_args.config.parallel.describe(), scaling)
    return create_app(engine_args, deployment, options)
