"""`RankGroup`: the rank actors of one Ray replica, and how they come up (placement, actors, setup, lane).

    group = RankGroup(index)                     # empty: the executor can release whatever gets filled in
    start_group(group, plan, ...)                # placement group, one rank actor per bundle, ranked by
                                                 # node, then setup (process groups, plugin create)
    lane = open_lane(group, proc, deadline, replies)   # the lane of `request_transport` (actors/lane.py)
    group.kill(); lane.close(); group.remove()   # the executor's teardown, in this order

`start_group` fills the group in as it goes (the placement group first, then the actors), so a start
that fails half-way leaves the executor holding everything to release: nothing is left behind. Every
wait is bounded by the one startup deadline. The lane's replies and failures go to the callbacks in
`LaneReplies`, which the executor (actors/ray_executor.py) gives.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import ipc, peer
from actors.compiled import CompiledLane
from actors.ipc import IpcLane
from actors.lane import ActorCallLane
from actors.placement_groups import create_replica_group, remove_group
from actors.protocol import ActorInfo, RankSpec
from actors.rank_actor import CONCURRENCY_GROUPS, RankActor
from actors.startup import gather_within
from phyai_ray.errors import StartupError
from placement.bundles import ReplicaPlan
from placement.spread import physical_device

logger = logging.getLogger(__name__)
RemoteRank = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RankActor)
_CONTROL_HEADROOM = 8  # lane slots beyond max_ongoing_requests, for collective_rpc calls


@dataclass
class RankGroup:
    """One replica's ranks: its placement group, rank actors (rank order once set up) and where they run."""

    index: int
    pg: Any = None
    owned_pg: bool = True  # False when the ranks run in a placement group someone else owns
    actors: list[Any] = field(default_factory=list)
    infos: list[ActorInfo] = field(default_factory=list)
    batchable: bool = False  # every rank's model has step_batch
    iterative: bool = False  # every rank's model has the iteration protocol

    def node(self, rank: int) -> str:
        """The node id of `rank`, or "?" before the ranks reported where they landed."""
        return self.infos[rank].node_id if rank < len(self.infos) else "?"

    def kill(self) -> None:
        """Kill every rank now (never rely on cancel: a rank may sit in a collective)."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                logger.debug("kill rank actor: %s", exc)

    def remove(self) -> None:
        """Remove the placement group, if this replica made it."""
        if self.owned_pg:
            remove_group(self.pg)


@dataclass(frozen=True)
class LaneReplies:
    """Where a lane's replies and failures go (the executor's methods; see actors/lane.py)."""

    on_reply: Callable[[Any, int, Any], None]  # (work, rank, envelope): sockets and actor calls
    on_replies: Callable[[Any, list], None]  # (work, every rank's envelope): the compiled graph
    on_unsent: Callable[[Any, BaseException], None]  # the request did not serialize: it fails alone
    on_socket_broken: Callable[[int, BaseException], None]  # a rank's socket closed
    on_lane_broken: Callable[[BaseException], None]  # the compiled graph stopped
    on_rank_error: Callable[[int, BaseException], None]  # an actor call raised, or its rank died
    on_send_failed: Callable[[int, BaseException], None]  # a request reached only some ranks


def start_group(group: RankGroup, plan: ReplicaPlan, *, entry: Any, args: Any, deployment: Any,
                device_type: str, target_node: str | None, deadline: float) -> None:
    """Place, create and set up the ranks of `plan` into `group` (see the module docstring)."""
    bundles = _place(group, plan, deployment, target_node, deadline)
    bundle = plan.bundles[0]
    options = dict(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
                   max_task_retries=0, runtime_env=deployment.runtime_env)
    actors = [RemoteRank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group.pg, placement_group_bundle_index=b), **options).remote() for b in bundles]
    group.actors = actors  # bundle order until ranks are assigned
    infos: list[ActorInfo] = gather_within([a.info.remote() for a in actors], deadline, group.index,
                                           "report where it landed")
    order = sorted(range(len(actors)), key=lambda i: (infos[i].node_id, i))
    group.actors, group.infos = [actors[i] for i in order], [infos[i] for i in order]
    proc = deployment.process_config
    port = proc.base_port + group.index if proc.base_port else \
        gather_within([group.actors[0].free_port.remote()], deadline, group.index, "pick a port")[0]
    specs = [_spec(group, rank, plan, entry, args, device_type, port, proc, deadline)
             for rank in range(plan.world_size)]
    ready = gather_within([a.setup.remote(s) for a, s in zip(group.actors, specs)], deadline, group.index,
                          "start (process groups and plugin create)", nodes=[i.node_id for i in group.infos])
    group.batchable = all(batchable for _, batchable, _ in ready)
    group.iterative = all(iterative for _, _, iterative in ready)
    logger.info("replica %d ready: %d rank(s) on node(s) %s, rendezvous %s:%d", group.index, plan.world_size,
                sorted({i.node_id[:8] for i in group.infos}), group.infos[0].ip, port)


def _place(group: RankGroup, plan: ReplicaPlan, deployment: Any, target_node: str | None,
           deadline: float) -> list[int]:
    """The placement group (into `group`) and the bundle of each rank: our own group, or the owner's
    (PlacementSpec)."""
    if deployment.placement is None:
        name = f"phyai-{uuid.uuid4().hex[:8]}-replica{plan.index}"
        group.pg = create_replica_group(plan, target_node=target_node, timeout_s=_left(deadline), name=name)
        return list(range(plan.world_size))
    spec = deployment.placements[plan.index]
    ready, _ = ray.wait([spec.placement_group.ready()], timeout=_left(deadline))
    if not ready:
        raise StartupError(f"replica {plan.index}: the given placement group {spec.placement_group.id.hex()} "
                           "was not ready before the startup deadline; check `ray status`", replica=plan.index)
    group.owned_pg, group.pg = False, spec.placement_group
    return list(spec.bundle_indices)


def _spec(group: RankGroup, rank: int, plan: ReplicaPlan, entry: Any, args: Any, device_type: str, port: int,
          proc: Any, deadline: float) -> RankSpec:
    visible = None
    if plan.devices is not None:
        visible = physical_device(plan.devices[rank], os.environ.get("CUDA_VISIBLE_DEVICES"))
    return RankSpec(rank=rank, replica_index=group.index, entry=entry, plugin_args=args.plugin_args,
                    parallel=args.config.parallel, params_dtype=args.config.device.params_dtype,
                    device_type=device_type, visible_device=visible, master_addr=group.infos[0].ip,
                    master_port=port, startup_timeout_s=max(_left(deadline), 1.0),
                    collective_timeout_s=proc.collective_timeout_s,
                    engine_node=ray.get_runtime_context().get_node_id(),
                    launcher_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))


def open_lane(group: RankGroup, proc: Any, deadline: float,
              replies: LaneReplies) -> IpcLane | CompiledLane | ActorCallLane:
    """The group's request lane (`proc.request_transport`): sockets when every rank is on the engine's
    node ("auto" or "ipc"), a compiled graph when asked, else actor calls."""
    choice = proc.request_transport
    here = ray.get_runtime_context().get_node_id()
    local = all(i.node_id == here for i in group.infos)
    capacity = proc.max_ongoing_requests + _CONTROL_HEADROOM
    name = f"phyai-replica-{group.index}"
    if choice == "ipc" or (choice == "auto" and local and ipc.SUPPORTED):
        if not local or not ipc.SUPPORTED:
            raise StartupError(f"replica {group.index}: request_transport='ipc' needs every rank on the engine's "
                               f"node and Linux (ranks on nodes {sorted({i.node_id[:12] for i in group.infos})}, "
                               f"engine on {here[:12]}); use 'auto' or 'actor_calls'", replica=group.index)
        return _ipc_lane(group, choice, capacity, name, deadline, replies)
    if choice != "compiled":
        return _actor_call_lane(group, name, replies)
    return CompiledLane(group.actors, capacity=capacity, name=name, on_replies=replies.on_replies,
                        on_broken=replies.on_lane_broken, on_unsent=replies.on_unsent)


def _ipc_lane(group: RankGroup, choice: str, capacity: int, name: str, deadline: float,
              replies: LaneReplies) -> IpcLane | ActorCallLane:
    """Sockets; under "auto", actor calls when connecting them fails (never when a foreign process answers)."""
    try:
        return IpcLane(group.actors, capacity=capacity, name=name, timeout_s=max(_left(deadline), 5.0),
                       on_reply=replies.on_reply, on_broken=replies.on_socket_broken, on_unsent=replies.on_unsent)
    except Exception as exc:
        if isinstance(exc, peer.PeerError):  # a foreign process on the line: never fall back silently
            raise StartupError(f"replica {group.index}: {exc}", replica=group.index) from exc
        if choice == "ipc":
            raise
        logger.warning("replica %d: connecting its request sockets failed (%s: %s); using actor calls",
                       group.index, type(exc).__name__, exc)
        return _actor_call_lane(group, name, replies)


def _actor_call_lane(group: RankGroup, name: str, replies: LaneReplies) -> ActorCallLane:
    return ActorCallLane(group.actors, name=name, on_reply=replies.on_reply, on_rank_error=replies.on_rank_error,
                         on_send_failed=replies.on_send_failed)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
