"""`ReplicaStartup`: how a Ray replica's ranks come up: placement, rank actors, process groups, the lane.

    _place        the replica's own placement group, or the owner's bundles (PlacementSpec)
    _start        one rank actor per bundle, ranks ordered by node, setup (process groups, plugin create)
    _request_lane the lane of `request_transport` (actors/lane.py): sockets when every rank is on the
                  engine's node, a compiled graph when asked, else actor calls

A part of `RayTransport` (actors/replica.py); every wait is bounded by the startup deadline.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import ipc, peer
from actors.compiled import CompiledLane
from actors.ipc import IpcLane
from actors.lane import ActorCallLane
from actors.placement_groups import create_replica_group
from actors.protocol import ActorInfo, RankSpec
from actors.rank_actor import CONCURRENCY_GROUPS, RankActor
from actors.startup import gather_within
from phyai_ray.errors import StartupError
from placement.bundles import ReplicaPlan
from placement.spread import physical_device

logger = logging.getLogger(__name__)
RemoteRank = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RankActor)
_CONTROL_HEADROOM = 8  # lane slots beyond max_ongoing_requests, for collective_rpc calls


class ReplicaStartup:
    """How the ranks of a `RayTransport` come up (see the module docstring)."""

    def _start(self, plan: ReplicaPlan, entry: Any, args: Any, deployment: Any, device_type: str,
               target_node: str | None, deadline: float) -> None:
        bundles = self._place(plan, deployment, target_node, deadline)
        bundle = plan.bundles[0]
        options = dict(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
                       max_task_retries=0, runtime_env=deployment.runtime_env)
        actors = [RemoteRank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self._pg, placement_group_bundle_index=b), **options).remote() for b in bundles]
        self._actors = actors  # bundle order until ranks are assigned
        infos: list[ActorInfo] = gather_within([a.info.remote() for a in actors], deadline, self.index,
                                               "report where it landed")
        order = sorted(range(len(actors)), key=lambda i: (infos[i].node_id, i))
        self._actors, self._infos = [actors[i] for i in order], [infos[i] for i in order]
        port = self._proc.base_port + self.index if self._proc.base_port else \
            gather_within([self._actors[0].free_port.remote()], deadline, self.index, "pick a port")[0]
        specs = [self._spec(rank, plan, entry, args, device_type, port, deadline) for rank in range(plan.world_size)]
        ready = gather_within([a.setup.remote(s) for a, s in zip(self._actors, specs)], deadline, self.index,
                              "start (process groups and plugin create)", nodes=[i.node_id for i in self._infos])
        self._batchable = all(batchable for _, batchable, _ in ready)
        self._iterative = all(iterative for _, _, iterative in ready)
        logger.info("replica %d ready: %d rank(s) on node(s) %s, rendezvous %s:%d", self.index, plan.world_size,
                    sorted({i.node_id[:8] for i in self._infos}), self._infos[0].ip, port)

    def _place(self, plan: ReplicaPlan, deployment: Any, target_node: str | None, deadline: float) -> list[int]:
        """The placement group and bundle of each rank: our own group, or the owner's (PlacementSpec)."""
        if deployment.placement is None:
            name = f"phyai-{uuid.uuid4().hex[:8]}-replica{plan.index}"
            self._pg = create_replica_group(plan, target_node=target_node, timeout_s=_left(deadline), name=name)
            return list(range(plan.world_size))
        spec = deployment.placements[plan.index]
        ready, _ = ray.wait([spec.placement_group.ready()], timeout=_left(deadline))
        if not ready:
            raise StartupError(f"replica {plan.index}: the given placement group {spec.placement_group.id.hex()} "
                               "was not ready before the startup deadline; check `ray status`", replica=plan.index)
        self._owned_pg, self._pg = False, spec.placement_group
        return list(spec.bundle_indices)

    def _spec(self, rank: int, plan: ReplicaPlan, entry: Any, args: Any, device_type: str, port: int,
              deadline: float) -> RankSpec:
        visible = None
        if plan.devices is not None:
            visible = physical_device(plan.devices[rank], os.environ.get("CUDA_VISIBLE_DEVICES"))
        return RankSpec(rank=rank, replica_index=self.index, entry=entry, plugin_args=args.plugin_args,
                        parallel=args.config.parallel, params_dtype=args.config.device.params_dtype,
                        device_type=device_type, visible_device=visible, master_addr=self._infos[0].ip,
                        master_port=port, startup_timeout_s=max(_left(deadline), 1.0),
                        collective_timeout_s=self._proc.collective_timeout_s,
                        engine_node=ray.get_runtime_context().get_node_id(),
                        launcher_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def _request_lane(self, deadline: float) -> IpcLane | CompiledLane | ActorCallLane:
        """This replica's request lane (see `request_transport`)."""
        choice = self._proc.request_transport
        here = ray.get_runtime_context().get_node_id()
        local = all(i.node_id == here for i in self._infos)
        capacity = self._proc.max_ongoing_requests + _CONTROL_HEADROOM
        name = f"phyai-replica-{self.index}"
        if choice == "ipc" or (choice == "auto" and local and ipc.SUPPORTED):
            if not local or not ipc.SUPPORTED:
                raise StartupError(f"replica {self.index}: request_transport='ipc' needs every rank on the engine's "
                                   f"node and Linux (ranks on nodes {sorted({i.node_id[:12] for i in self._infos})}, "
                                   f"engine on {here[:12]}); use 'auto' or 'actor_calls'", replica=self.index)
            try:
                return IpcLane(self._actors, capacity=capacity, name=name, timeout_s=max(_left(deadline), 5.0),
                               on_reply=self._on_lane_reply, on_broken=self._on_socket_broken,
                               on_unsent=self._on_unsent)
            except Exception as exc:
                if isinstance(exc, peer.PeerError):  # a foreign process on the line: never fall back silently
                    raise StartupError(f"replica {self.index}: {exc}", replica=self.index) from exc
                if choice == "ipc":
                    raise
                logger.warning("replica %d: connecting its request sockets failed (%s: %s); using actor calls",
                               self.index, type(exc).__name__, exc)
                return self._actor_call_lane(name)
        if choice != "compiled":
            return self._actor_call_lane(name)
        return CompiledLane(self._actors, capacity=capacity, name=name, on_replies=self._on_compiled_replies,
                            on_broken=self._on_lane_broken, on_unsent=self._on_unsent)

    def _actor_call_lane(self, name: str) -> ActorCallLane:
        return ActorCallLane(self._actors, name=name, on_reply=self._on_lane_reply,
                             on_rank_error=lambda rank, exc: self._fail(self._rank_error(rank, exc)),
                             on_send_failed=lambda rank, exc: self._fail(self._send_error(rank, exc)))


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
