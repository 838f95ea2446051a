"""`RayReplicaExecutor`: one replica = one placement group of rank actors forming a process group.

Request path (`WorkerSupervisorConfig.request_transport`). Same-node sockets (`auto` picks them
where every rank is on the engine's node): `actors.ipc.IpcLane` writes each dispatched request,
pickled once in the caller's thread with its large tensors in shared memory, to one Unix socket
per rank; each rank's request thread runs them in order and writes its reply back; waiting threads
block in the kernel, so idle replicas use no CPU. Actor calls (the fallback, e.g. across nodes):
the request is serialized once (`ray.put`, in the caller's thread, before it is queued) and the
same reference goes to every rank with the next sequence number; every rank runs requests in
sequence order; replies are handed from Ray's threads to this replica's reply thread. Compiled
(only when asked for): one Ray Compiled Graph per replica (`actors.compiled.CompiledLane`), whose
channel readers poll, a core each. Either way the request waits in the replica's engine-side
scheduler until a slot is free, the output rank's reply resolves the future, and no thread of the
request path runs user code (done-callbacks run on the engine's callback thread), so a callback
may call the engine again. Liveness pings always use normal actor calls on the ranks' control lane.

Fail-fast: a rank that dies (noticed by its pending replies or a ping on the control lane every
`liveness_interval_s`), raises, replies malformed, runs one request past its limit, or cannot be
sent a request fails the whole replica: it is marked unavailable first, every queued and
dispatched request fails with `EngineUnavailableError` naming the cause, then every rank is killed
and the placement group removed. Nothing is retried or restarted here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import ipc, peer
from actors.compiled import CompiledLane
from actors.lane import ActorCallLane
from actors.ipc import IpcLane
from actors.placement_groups import create_replica_group, remove_group
from actors.protocol import ERROR, MISSING, ActorInfo, LaneRequest, RankReply, RankSpec
from actors.rank_actor import CONCURRENCY_GROUPS, RankActor
from actors.remote_streams import RemoteReader
from actors.startup import gather_within
from phyai_ray.errors import EngineUnavailableError, StartupError
from phyai_ray.executors.base import ReplicaExecutor
from phyai_ray.work import Work
from phyai_ray.work import Kind
from placement.bundles import ReplicaPlan
from placement.spread import physical_device
from placement.topology import Topology

logger = logging.getLogger(__name__)
RemoteRank = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RankActor)
_CONTROL_HEADROOM = 8  # compiled graph slots beyond max_ongoing_requests, for collective_rpc calls


@dataclass
class _Sent:
    """Which ranks still owe a reply for one dispatched request or rpc."""

    seq: int
    pending: set[int]
    replies: dict[int, RankReply] = field(default_factory=dict)


class RayReplicaExecutor(ReplicaExecutor):
    """A replica whose ranks are Ray actors in one placement group."""

    mode = "ray"

    def __init__(self, plan: ReplicaPlan, *, entry: Any, args: Any, deployment: Any, device_type: str,
                 target_node: str | None, deadline: float) -> None:
        self._proc = deployment.process_config
        super().__init__(plan.index, plan.world_size, max_ongoing=self._proc.max_ongoing_requests,
                         max_queued=self._proc.max_queued_requests, step_limit_s=self._proc.execution_timeout_s)
        self._output_rank = Topology.from_parallel(args.config.parallel).output_rank
        self._replica_count = deployment.replica_count
        self._teardown_lock = threading.Lock()
        self._seq = 0
        self._pg, self._actors, self._infos = None, [], []
        self._owned_pg = True  # False when the ranks run in a placement group someone else owns
        self._torn_down = False
        self._stop = threading.Event()
        self._lane: IpcLane | CompiledLane | ActorCallLane | None = None  # set once the ranks are up
        try:
            self._start(plan, entry, args, deployment, device_type, target_node, deadline)
            self._lane = self._request_lane(deadline)
        except BaseException:
            self._teardown()
            raise
        self.enable_batching(deployment.batching, self._batchable)
        self.enable_iterations(entry, deployment.batching, self._iterative)
        threading.Thread(target=self._liveness_loop, name=f"phyai-replica-{plan.index}-liveness", daemon=True).start()

    @property
    def transport(self) -> str:
        """How requests reach the ranks: "ipc" (same-node sockets), "compiled" (a Ray Compiled Graph)
        or "actor_calls" (actors/lane.py)."""
        return self._lane.name

    # -- startup ----------------------------------------------------------------------------
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

    # -- requests ---------------------------------------------------------------------------
    def _prepare(self, payload: Any) -> Any:
        """Serialize once, in the caller's thread, before a slot or sequence number is taken (a bad
        payload loses nothing): the lane's own form (see actors/lane.py)."""
        return self._lane.prepare(payload)

    def _weight(self, payload: Any) -> int:
        return self._lane.weight(payload)

    def _max_batch_weight(self) -> int | None:
        return self._lane.max_batch_weight

    def _lane_payload(self, work: Work) -> Any:
        """A batch's payloads as one message of the lane's; any other work's payload as it is."""
        return self._lane.batch(work.payload) if work.kind == Kind.BATCH else work.payload

    def _launch(self, work: Work) -> None:
        """Send `work` to every rank with the next sequence number, or fail the replica at once."""
        sent = _Sent(self._seq, set(range(self.world_size)))
        self._seq += 1
        work.state = sent
        if work.launched is not None:  # a stream's reader waits for it (see _submit_stream)
            work.launched.set()
        reply_ranks = frozenset(range(self.world_size)) if work.kind == Kind.CALL and work.all_ranks else \
            frozenset((self._output_rank,))
        window = min(self._lane.in_flight + 1, self._lane.capacity)
        self._lane.send(work, LaneRequest(sent.seq, work.kind, self._lane_payload(work), reply_ranks, window))

    def _submit_stream(self, request: Any, max_buffered: int) -> tuple[Future, Any]:
        future = self.scheduler.submit(Kind.STREAM, self._prepare((request, max_buffered)), self._step_limit_s)
        work = future.work
        work.launched = threading.Event()
        if work.state is not None:  # launched before the event was there
            work.launched.set()
        return future, RemoteReader(self, work)

    def _on_compiled_replies(self, work: Work, replies: list) -> None:
        """Every rank's reply to one compiled-graph message (the lane's reader thread)."""
        for rank, envelope in enumerate(replies):
            if self._failure is not None:
                return
            self._on_envelope(work, rank, envelope)

    def _on_lane_reply(self, work: Work, rank: int, envelope: Any) -> None:
        """One rank's reply (the lane's reader thread: sockets, actor calls)."""
        if self._failure is None:
            self._on_envelope(work, rank, envelope)

    def _on_socket_broken(self, rank: int, exc: BaseException) -> None:
        """A rank's socket closed or carried garbage: its process exited, or its request thread stopped."""
        if self._failure is not None:
            return
        try:  # the cause Ray knows, when it already knows it (the socket usually closes first)
            ray.get(self._actors[rank].ping.remote(), timeout=1.0)
        except ray.exceptions.RayActorError as dead:
            self._fail(self._rank_error(rank, dead))
            return
        except Exception:
            pass
        error = EngineUnavailableError(
            f"replica {self.index} rank {rank} (node {self._node(rank)[:12]}) stopped serving: its request socket "
            f"closed ({type(exc).__name__}: {exc}; its process exited or its request thread stopped); the replica's ranks share collectives, so the whole replica was stopped",
            reason="worker_exit", replica=self.index, rank=rank, node=self._node(rank), detail=str(exc)[:2000])
        error.__cause__ = exc
        self._fail(error)

    def _on_unsent(self, work: Work, exc: BaseException) -> None:
        """The request did not serialize: nothing reached a rank, so it fails alone."""
        self.scheduler.deliver(work, error=exc)
        self.scheduler.finished(work)

    def _on_lane_broken(self, exc: BaseException) -> None:
        """The compiled graph stopped (a rank died, or it was torn down): fail with the rank's cause."""
        if self._failure is not None:
            return
        self._fail(self._dead_rank_error() or EngineUnavailableError(
            f"replica {self.index}: its compiled request graph failed ({type(exc).__name__}: "
            f"{str(exc).strip()[:300]}); the replica was stopped", reason="exception", replica=self.index,
            detail=str(exc)[:2000]))

    def _dead_rank_error(self) -> EngineUnavailableError | None:
        """The error of the first rank that does not answer a ping on its control lane, if any."""
        pings = [actor.ping.remote() for actor in self._actors]
        for rank, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=2.0)
            except ray.exceptions.RayActorError as exc:
                return self._rank_error(rank, exc)
            except Exception:
                continue
        return None

    def _on_envelope(self, work: Work, rank: int, envelope: Any) -> None:
        sent: _Sent = work.state
        if isinstance(envelope, RankReply) and envelope.status == ERROR and envelope.matches(sent.seq, rank):
            self._fail(self._rank_error(rank, envelope.value))
            return
        if not isinstance(envelope, RankReply) or not envelope.matches(sent.seq, rank):
            self._fail(EngineUnavailableError(
                f"replica {self.index} rank {rank} sent a malformed reply to request {sent.seq}: {envelope!r:.200}",
                reason="malformed", replica=self.index, rank=rank, node=self._node(rank)))
            return
        sent.replies[rank] = envelope
        sent.pending.discard(rank)
        if work.kind != Kind.CALL and rank == self._output_rank:
            self.scheduler.deliver(work, envelope.value)
        if not sent.pending:
            if work.kind == Kind.CALL:
                self._deliver_rpc(work, sent)
            self.scheduler.finished(work)

    def _deliver_rpc(self, work: Work, sent: _Sent) -> None:
        ranks = sorted(sent.replies)
        missing = [sent.replies[r].value for r in ranks if sent.replies[r].status == MISSING]
        if missing:
            self.scheduler.deliver(work, error=AttributeError(missing[0]))
        elif work.all_ranks:
            self.scheduler.deliver(work, [sent.replies[r].value for r in ranks])
        else:
            self.scheduler.deliver(work, sent.replies[self._output_rank].value)

    def _control_ranks(self, op: str, args: tuple, timeout_s: float) -> Future:
        refs = [a.control.remote(op, self.rank_args(op, args, rank)) for rank, a in enumerate(self._actors)]
        future: Future = Future()

        def gather() -> None:
            try:
                future.set_result(ray.get(refs, timeout=timeout_s))
            except ray.exceptions.GetTimeoutError:
                future.set_exception(TimeoutError(f"control op {op!r} got no reply from every rank in {timeout_s:.1f}s"))
            except BaseException as exc:
                future.set_exception(exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause else exc)
        threading.Thread(target=gather, name=f"phyai-replica-{self.index}-control", daemon=True).start()
        return future

    # -- failure ----------------------------------------------------------------------------
    def _rank_error(self, rank: int, exc: BaseException) -> EngineUnavailableError:
        dead = isinstance(exc, ray.exceptions.RayActorError)
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None else exc
        what = "exited" if dead else f"raised {type(cause).__name__}: {str(cause).strip().splitlines()[-1:]}"
        error = EngineUnavailableError(
            f"replica {self.index} rank {rank} (node {self._node(rank)[:12]}) {what}; the replica's ranks share "
            "collectives, so the whole replica was stopped", reason="worker_exit" if dead else "exception",
            replica=self.index, rank=rank, node=self._node(rank), detail=str(cause)[:2000])
        error.__cause__ = cause
        return error

    def _send_error(self, rank: int, exc: BaseException) -> EngineUnavailableError:
        error = EngineUnavailableError(
            f"replica {self.index}: sending a request to rank {rank} failed ({type(exc).__name__}: {exc}) after "
            f"{rank} rank(s) had it; ranks that share collectives cannot run it one-sidedly, so the replica was "
            "stopped", reason="worker_exit", replica=self.index, rank=rank, node=self._node(rank))
        error.__cause__ = exc
        return error

    def _hang_detail(self, work: Work) -> tuple[int | None, str | None, str]:
        waiting = sorted(work.state.pending) if work.state is not None else []
        first = waiting[0] if waiting else None
        return first, (self._node(first) if first is not None else None), f"rank(s) {waiting} had not replied"

    def _liveness_loop(self) -> None:
        """Ping every rank each interval; a failed ping is a dead rank, a ping stuck too long a hung one."""
        interval = self._proc.liveness_interval_s
        hang_s = max(10.0, 40 * interval)
        outstanding: dict[int, tuple[Future, float]] = {}
        while not self._stop.wait(interval) and self._failure is None:
            for rank, actor in enumerate(self._actors):
                error = self._check_ping(rank, actor, outstanding, hang_s)
                if error is not None:
                    self._fail(error)
                    return

    def _check_ping(self, rank: int, actor: Any, outstanding: dict, hang_s: float) -> EngineUnavailableError | None:
        if rank not in outstanding:
            outstanding[rank] = (actor.ping.remote().future(), time.monotonic())
            return None
        ping, sent = outstanding[rank]
        if ping.done():
            del outstanding[rank]
            return self._rank_error(rank, ping.exception()) if ping.exception() is not None else None
        if time.monotonic() - sent > hang_s:
            return EngineUnavailableError(
                f"replica {self.index} rank {rank} did not answer a liveness ping for {hang_s:.0f}s on its control "
                "lane (the process is stuck outside Python or its node is unreachable)",
                reason="worker_exit", replica=self.index, rank=rank, node=self._node(rank))
        return None

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        if self._set_failure(self._closed_error()):
            self._stop_iterations(cancel_waiting=True)
            self.scheduler.stop(self.unavailable_error, cancel_queued=True)
        self._teardown()

    def _teardown(self) -> None:
        """Kill every rank (never rely on cancel: a rank may sit in a collective), remove the group."""
        with self._teardown_lock:
            if self._torn_down:
                return
            self._torn_down = True
        self._stop.set()
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                logger.debug("kill rank actor: %s", exc)
        if self._lane is not None:
            self._lane.close()  # after the kills: a rank stuck in a step cannot hold the teardown up
        if self._owned_pg:
            remove_group(self._pg)

    def nodes(self) -> tuple[str, ...]:
        return tuple(i.node_id for i in self._infos)

    def pids(self) -> tuple[int, ...]:
        return tuple(i.pid for i in self._infos)

    def actor(self, rank: int) -> Any:
        return self._actors[rank]

    def _node(self, rank: int) -> str:
        return self._infos[rank].node_id if rank < len(self._infos) else "?"


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
