"""`ReplicaGroup`: the Serve deployment in which every Serve replica is ONE replica group.

    HTTP -> Serve proxy -> FewestInFlightRouter -> ReplicaGroup replica (FastAPI + Engine of ONE group)
                                                     ranks: Ray actors in the replica's placement group

A group of N ranks reserves its placement group through Serve's `placement_group_bundles` (one
bundle per rank, the DeploymentConfig's strategy); the Serve replica itself takes no CPU and sits
in bundle 0 beside rank 0, and the ranks run in bundles 0..N-1 through
`DeploymentConfig(placement=PlacementSpec(...))`, so Serve's placement group outlives them. A
group of one rank runs it inline, inside the Serve replica, which then reserves the rank's CPU
(and GPU) itself: no placement group, no rank actor, no hop.

Serve calls `check_health`, which fails while the group has failed: Serve replaces this replica
(new placement group, new ranks) while the other groups keep serving; that is the restart.
Autoscaling adds and removes whole groups. `record_routing_stats` tells every router that the
group failed; until Serve has replaced it, a request that reaches it is forwarded to another group
(`GroupRunner`). Handles of the deployment work from other apps, tasks and actors:

    handle = serve.get_deployment_handle("ReplicaGroup", app_name="phyai")
    result = await handle.step.remote(request)      # or handle.step.remote(request).result()
"""

from __future__ import annotations

import asyncio
import logging
import math
from functools import partial
from typing import Any

from ray import serve

from phyai_ray.config.deployment import DeploymentConfig, PlacementSpec
from phyai_ray.config.engine import EngineArgs
from phyai_ray.errors import DeploymentConfigError
from phyai_ray.serve.runtime.direct import enabled as direct_ingress, own_direct_port
from phyai_ray.serve.runtime.holder import EngineHolder
from phyai_ray.serve.protocols.oip.servicer import OipGrpcMethods
from phyai_ray.serve.runtime.options import ServeOptions
from phyai_ray.serve.runtime.registry import FAILED_STAT, REPORT_INTERVAL_S, set_failed
from phyai_ray.serve.runtime.runner import GroupRunner

logger = logging.getLogger(__name__)

RESULT_GRACE_S = 30.0  # a request waits its limit (execution_timeout_s, else the hang limit) plus this before a 504


def group_config(engine_args: EngineArgs, deployment: DeploymentConfig, placement_group: Any) -> DeploymentConfig:
    """The DeploymentConfig of the ONE group a Serve replica runs: inline for one rank, else its ranks
    in bundles 0..N-1 of the replica's placement group (which Serve owns)."""
    world = engine_args.config.parallel.infer_replica_world_size()
    common = dict(process_config=deployment.process_config, runtime_env=deployment.runtime_env,
                  batching=deployment.batching)
    if world == 1:
        return DeploymentConfig(mode="inline", **common)
    if placement_group is None:
        raise DeploymentConfigError(f"a group of {world} ranks runs in its Serve replica's placement group, but "
                                    "this replica has none; deploy it with create_app/build_app, which sets "
                                    "placement_group_bundles")
    return DeploymentConfig(mode="local", placement=PlacementSpec(placement_group, tuple(range(world))),
                            cpus_per_rank=deployment.cpus_per_rank, **common)


@serve.ingress()
class ReplicaGroup(OipGrpcMethods):
    """One Serve replica = one replica group: the HTTP edge, the handle method `step`, health and routing stats.

    The Open Inference Protocol's gRPC methods (ModelInfer, ...) come from `OipGrpcMethods`.
    """

    async def __init__(self, engine_args: EngineArgs, deployment: DeploymentConfig, options: ServeOptions,
                       registry: Any) -> None:
        import ray

        from phyai_ray.engine import Engine

        context = serve.get_replica_context()
        self.group, self.options, self.registry = context.replica_id.unique_id, options, registry
        self._peers = serve.get_deployment_handle(context.deployment, context.app_name)
        config = group_config(engine_args, deployment, ray.util.get_current_placement_group())
        holder = await asyncio.to_thread(EngineHolder, partial(Engine, engine_args, config),
                                         rebuild_failed=options.rebuild_failed)
        proc = deployment.process_config  # a whole result: its cap plus the grace, else no bound here
        result_wait_s = math.inf if proc.execution_timeout_s is None else proc.execution_timeout_s + RESULT_GRACE_S
        self.runner = GroupRunner(holder, group=self.group, wait_s=proc.step_limit_s + RESULT_GRACE_S,
                                  result_wait_s=result_wait_s, forward=self._forward,
                                  forward_stream=self._forward_stream)
        self.runner.routable = False  # "starting" until Serve's first health check: routers know it by then
        self.api: Any = None
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())
        logger.info("replica group %s ready: pids %s", self.group, holder.engine.replica_status()[0].pids)

    def __serve_build_asgi_app__(self) -> Any:
        from phyai_ray.serve.protocols.http import create_api

        if self.api is None:  # Serve may ask more than once; requests and reports must share one app
            self.api = create_api(self.runner, self.options)
            self.runner.holder.on_rebuild = self.api.state.metrics.count_rebuild
        return self.api

    async def step(self, request: Any, hops: int = 0, failed: tuple = (), deadline_s: float | None = None,
                   late: str | None = None) -> Any:
        """The handle method: `await handle.step.remote(request)` -> the plugin's result, or the engine's error.

        `hops` and `failed` are set by a failed group that forwards the request (see GroupRunner); a
        request is validated once, by the first group it reaches (`RequestRejectedError`).
        `deadline_s` (seconds from this call) and `late` are `Engine.submit`'s; a forwarded request
        carries what is left of its deadline.
        """
        return await self.runner.run(request, hops=hops, failed=failed, deadline_s=deadline_s, late=late)

    async def stream(self, request: Any, hops: int = 0, failed: tuple = (), deadline_s: float | None = None) -> Any:
        """The streaming handle method: `handle.options(stream=True).stream.remote(request)` yields lists of
        ("chunk" | "end" | "error", value) items (see `phyai_ray.async_streams`), validated and forwarded
        like `step`; `deadline_s` (seconds from this call) is its first chunk's deadline."""
        async for items in self.runner.stream(request, hops=hops, failed=failed, deadline_s=deadline_s):
            yield items

    def _forward(self, request: Any, hops: int, failed: tuple, **deadline: Any) -> Any:
        return self._peers.step.remote(request, hops=hops, failed=failed, **deadline)

    def _forward_stream(self, request: Any, hops: int, failed: tuple, **deadline: Any) -> Any:
        return self._peers.options(stream=True).stream.remote(request, hops=hops, failed=failed, **deadline)

    def check_health(self) -> None:
        """Raise (unhealthy, so Serve replaces this replica) while the group has failed."""
        self.runner.routable = True
        try:
            self.runner.holder.check_health()
        finally:
            self._publish_failed()
        if self.api is not None:
            self.api.state.metrics.refresh_ray()

    def record_routing_stats(self) -> dict[str, Any]:
        """What every router of the deployment learns about this group (Serve polls it)."""
        return {FAILED_STAT: self._publish_failed()}

    def _publish_failed(self) -> bool:
        failed = not self.runner.engine.healthy
        set_failed(self.group, failed)
        return failed

    async def _report_loop(self) -> None:
        """Send this group's report to the registry and keep every group's reports, each REPORT_INTERVAL_S."""
        while True:
            try:
                counts = self.api.state.metrics.request_counts() if self.api is not None else ()
                if self.runner.direct is None and direct_ingress():  # Serve opens it after __init__
                    self.runner.direct = own_direct_port()
                report = self.runner.report(counts)
                self._publish_failed()
                self.runner.view = await asyncio.wait_for(_awaited(self.registry.report.remote(report)), 5.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the registry restarting, or this replica shutting down
                logger.debug("group %s: report to the registry failed: %s", self.group, exc)
            await asyncio.sleep(REPORT_INTERVAL_S)

    def __del__(self) -> None:
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.holder.close()


async def _awaited(response: Any) -> Any:
    return await response
