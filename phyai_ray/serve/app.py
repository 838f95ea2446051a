"""The Ray Serve application: one ingress deployment that owns an `Engine` and serves it over HTTP.

Three ways to start it:

    serve run phyai_ray.serve:build_app plugin=reference_dit dense_tp_size=2 replicas=2 device=cpu
    serve run config.yaml          # applications: [{import_path: phyai_ray.serve:build_app, args: {...}}]
    serve.run(create_app(EngineArgs(plugin="reference_dit"), DeploymentConfig.local(replica_count=2)))

The ingress is ONE Serve replica with no CPU of its own (`num_cpus=0`): the engine's dispatcher
is the router (fewest in flight, ties to the least recently chosen), and the CPUs/GPUs go to the
rank actors of the engine's replica groups (one placement group each). Serve's health checks
call `check_health`, which fails while no replica group can serve, so Serve replaces the
ingress (or, with `rebuild_failed=True`, the ingress restarts failed replica groups in place).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any, Mapping

from ray import serve
from ray.serve import Application

from phyai_ray.config.deployment import DeploymentConfig
from phyai_ray.config.engine import EngineArgs
from phyai_ray.serve.holder import EngineHolder
from phyai_ray.serve.options import ServeOptions, parse_app_args

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "EngineIngress"
RESULT_GRACE_S = 30.0  # a request waits execution_timeout_s plus this for its result before a 504


@serve.ingress()
class EngineIngress:
    """Serve replica: builds the engine, then the FastAPI app around it (late-bound ASGI app)."""

    async def __init__(self, engine_args: EngineArgs, deployment: DeploymentConfig, options: ServeOptions) -> None:
        from phyai_ray.engine import Engine

        self.options = options
        self.wait_s = deployment.process_config.execution_timeout_s + RESULT_GRACE_S
        self.holder = await asyncio.to_thread(EngineHolder, partial(Engine, engine_args, deployment),
                                              rebuild_failed=options.rebuild_failed)
        self.api: Any = None

    def __serve_build_asgi_app__(self) -> Any:
        from phyai_ray.serve.http import create_api

        self.api = create_api(self.holder, self.options, wait_s=self.wait_s)
        self.holder.on_rebuild = self.api.state.metrics.count_rebuild
        return self.api

    def check_health(self) -> None:
        """Raise (unhealthy) while no replica group can serve; may start an in-place rebuild."""
        self.holder.check_health()
        if self.api is not None:
            self.api.state.metrics.refresh_ray()

    def __del__(self) -> None:
        holder = getattr(self, "holder", None)
        if holder is not None:
            holder.close()


def create_app(engine_args: EngineArgs, deployment: DeploymentConfig | None = None,
               options: ServeOptions | None = None, **option_values: Any) -> Application:
    """A bound Serve application: `serve.run(create_app(args, DeploymentConfig.local(replica_count=2)))`.

    `option_values` are `ServeOptions` fields (api_key=..., max_body_bytes=..., rebuild_failed=...).
    """
    options = ServeOptions(**{**(options.model_dump() if options else {}), **option_values})
    deployment = deployment or DeploymentConfig()
    ingress = serve.deployment(
        EngineIngress, name=DEPLOYMENT_NAME, num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=options.max_ongoing_requests, health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=options.health_check_timeout_s,
        graceful_shutdown_timeout_s=deployment.process_config.shutdown_timeout_s + 10)
    return ingress.bind(engine_args, deployment, options)


def build_app(args: Mapping[str, Any]) -> Application:
    """The builder `serve run phyai_ray.serve:build_app key=value ...` and config files name."""
    engine_args, deployment, options = parse_app_args(args)
    logger.info("phyai-ray serve app: plugin=%s %s replicas=%d", engine_args.plugin,
                engine_args.config.parallel.describe(), deployment.replica_count)
    return create_app(engine_args, deployment, options)
