"""`RayReplicaExecutor`: one replica = one placement group of rank actors forming a process group.

Request path: the request is serialized once (`ray.put`), the same reference goes to every rank
with a sequence number, every rank runs requests in sequence order, and the output rank's reply
resolves the future. Fail-fast: a rank that dies (noticed by its pending replies or a ping every
`liveness_interval_s`), raises, replies malformed, or outlives `execution_timeout_s` fails the
whole replica: it is marked unavailable first, its pending futures fail with
`EngineUnavailableError` naming the cause, then every rank is killed and the placement group
removed. Nothing is retried or restarted here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.placement_groups import create_replica_group, remove_group
from actors.rank_actor import RankActor
from actors.startup import gather_within
from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.base import ReplicaExecutor, fail_future, resolve_future
from phyai_ray.executors.deadlines import DeadlineWatch
from placement.bundles import ReplicaPlan
from placement.spread import physical_device
from placement.topology import Topology

logger = logging.getLogger(__name__)
RemoteRank = ray.remote(RankActor)


@dataclass
class _Call:
    """One request or rpc in flight on every rank of the replica."""

    seq: int
    kind: str
    future: Future
    all_ranks: bool
    timeout_s: float
    pending: set[int]
    replies: dict[int, dict] = field(default_factory=dict)


class RayReplicaExecutor(ReplicaExecutor):
    """A replica whose ranks are Ray actors in one placement group."""

    mode = "ray"

    def __init__(self, plan: ReplicaPlan, *, entry: Any, args: Any, deployment: Any, device_type: str,
                 target_node: str | None, deadline: float) -> None:
        super().__init__(plan.index, plan.world_size)
        self._proc = deployment.process_config
        self._topology = Topology.from_parallel(args.config.parallel)
        self._lock, self._teardown_lock = threading.Lock(), threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._seq = 0
        self._pg, self._actors, self._infos = None, [], []
        self._torn_down = False
        self._stop = threading.Event()
        self._watch = DeadlineWatch(self._expired, name=f"phyai-replica-{plan.index}-deadlines")
        try:
            self._start(plan, entry, args, deployment, device_type, target_node, deadline)
        except BaseException:
            self._teardown()
            raise
        self._monitor = threading.Thread(target=self._liveness_loop, name=f"phyai-replica-{plan.index}-liveness",
                                         daemon=True)
        self._monitor.start()

    # -- startup ----------------------------------------------------------------------------
    def _start(self, plan: ReplicaPlan, entry: Any, args: Any, deployment: Any, device_type: str,
               target_node: str | None, deadline: float) -> None:
        name = f"phyai-{uuid.uuid4().hex[:8]}-replica{plan.index}"
        self._pg = create_replica_group(plan, target_node=target_node, timeout_s=_left(deadline), name=name)
        bundle = plan.bundles[0]
        options = dict(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
                       max_task_retries=0, runtime_env=deployment.runtime_env)
        actors = [RemoteRank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self._pg, placement_group_bundle_index=i), **options).remote() for i in range(plan.world_size)]
        self._actors = actors  # bundle order until ranks are assigned
        infos = gather_within([a.info.remote() for a in actors], deadline, self.index, "report where it landed")
        order = sorted(range(len(actors)), key=lambda i: (infos[i]["node_id"], i))
        self._actors, self._infos = [actors[i] for i in order], [infos[i] for i in order]
        port = self._proc.base_port + self.index if self._proc.base_port else \
            gather_within([self._actors[0].free_port.remote()], deadline, self.index, "pick a port")[0]
        specs = [self._spec(rank, plan, entry, args, device_type, port, deadline) for rank in range(plan.world_size)]
        gather_within([a.setup.remote(s) for a, s in zip(self._actors, specs)], deadline, self.index,
                      "start (process groups and plugin create)", nodes=[i["node_id"] for i in self._infos])
        logger.info("replica %d ready: %d rank(s) on node(s) %s, rendezvous %s:%d", self.index, plan.world_size,
                    sorted({i["node_id"][:8] for i in self._infos}), self._infos[0]["ip"], port)

    def _spec(self, rank: int, plan: ReplicaPlan, entry: Any, args: Any, device_type: str, port: int,
              deadline: float) -> dict[str, Any]:
        visible = None
        if plan.devices is not None:
            visible = physical_device(plan.devices[rank], os.environ.get("CUDA_VISIBLE_DEVICES"))
        return {"rank": rank, "replica_index": self.index, "entry": entry, "plugin_args": args.plugin_args,
                "parallel": args.config.parallel, "params_dtype": args.config.device.params_dtype,
                "device_type": device_type, "visible_device": visible, "master_addr": self._infos[0]["ip"],
                "master_port": port, "timeout_s": max(_left(deadline), 1.0)}

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: Any) -> Future:
        return self._send("step", request, self._proc.execution_timeout_s, all_ranks=False)

    def collective_rpc(self, method: str, args: tuple, kwargs: dict, timeout_s: float,
                       all_ranks: bool = False) -> Future:
        return self._send("call", (method, tuple(args), dict(kwargs)), timeout_s, all_ranks)

    def _send(self, kind: str, payload: Any, timeout_s: float, all_ranks: bool) -> Future:
        if self._failure is not None:
            raise self.unavailable_error()
        ref = ray.put(payload)  # serialized once, before a sequence number is taken: a bad payload loses nothing
        future: Future = Future()
        with self._lock:
            if self._failure is not None:
                raise self.unavailable_error()
            call = _Call(self._seq, kind, future, all_ranks, timeout_s, set(range(self.world_size)))
            self._seq += 1
            self._calls[call.seq] = call
            replies = [a.execute.remote(call.seq, kind, ref) for a in self._actors]
        self._watch.add(future, time.monotonic() + timeout_s)
        for rank, reply in enumerate(replies):
            reply.future().add_done_callback(partial(self._on_reply, call, rank))
        return future

    def _on_reply(self, call: _Call, rank: int, reply: Future) -> None:
        try:
            envelope = reply.result()
        except BaseException as exc:
            self._fail(self._rank_error(rank, exc))
            return
        if not _well_formed(envelope, call.seq, rank):
            self._fail(EngineUnavailableError(
                f"replica {self.index} rank {rank} sent a malformed reply to request {call.seq}: {envelope!r:.200}",
                reason="malformed", replica=self.index, rank=rank, node=self._node(rank)))
            return
        with self._lock:
            call.replies[rank] = envelope
            call.pending.discard(rank)
            finished = not call.pending
            if finished:
                self._calls.pop(call.seq, None)
        if call.kind == "step" and rank == self._topology.output_rank:
            resolve_future(call.future, envelope["value"])
        elif call.kind == "call" and finished:
            _deliver_rpc(call, self._topology.output_rank)

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

    def _expired(self, future: Future) -> None:
        with self._lock:
            call = next((c for c in self._calls.values() if c.future is future), None)
        waiting = sorted(call.pending) if call else []
        limit = (f"execution_timeout_s={self._proc.execution_timeout_s}" if call is None or call.kind == "step"
                 else f"its collective_rpc timeout of {call.timeout_s}s")
        self._fail(EngineUnavailableError(
            f"replica {self.index}: a {call.kind if call else 'call'} exceeded {limit} (counted from submission); "
            f"rank(s) {waiting} had not replied, so the replica was stopped",
            reason="timeout", replica=self.index, rank=waiting[0] if waiting else None,
            node=self._node(waiting[0]) if waiting else None))

    def _fail(self, error: EngineUnavailableError) -> None:
        """Mark unavailable, fail every pending future, then kill the ranks (on another thread)."""
        if not self._set_failure(error):
            return
        logger.error("%s", error)
        self._fail_pending()
        threading.Thread(target=self._teardown, name=f"phyai-replica-{self.index}-teardown", daemon=True).start()

    def _fail_pending(self) -> None:
        with self._lock:
            calls = list(self._calls.values())
            self._calls.clear()
        for call in calls:
            fail_future(call.future, self.unavailable_error())

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
                f"replica {self.index} rank {rank} did not answer a liveness ping for {hang_s:.0f}s",
                reason="worker_exit", replica=self.index, rank=rank, node=self._node(rank))
        return None

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        if self._set_failure(EngineUnavailableError(f"replica {self.index} is closed", reason="closed",
                                                    replica=self.index)):
            self._fail_pending()
        self._teardown()

    def _teardown(self) -> None:
        """Kill every rank (never rely on cancel: a rank may sit in a collective), remove the group."""
        with self._teardown_lock:
            if self._torn_down:
                return
            self._torn_down = True
        self._stop.set()
        self._watch.close()
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                logger.debug("kill rank actor: %s", exc)
        remove_group(self._pg)

    def nodes(self) -> tuple[str, ...]:
        return tuple(i["node_id"] for i in self._infos)

    def pids(self) -> tuple[int, ...]:
        return tuple(i["pid"] for i in self._infos)

    def actor(self, rank: int) -> Any:
        return self._actors[rank]

    def _node(self, rank: int) -> str:
        return self._infos[rank]["node_id"] if rank < len(self._infos) else "?"


def _well_formed(envelope: Any, seq: int, rank: int) -> bool:
    return (isinstance(envelope, dict) and envelope.get("seq") == seq and envelope.get("rank") == rank
            and envelope.get("status") in ("ok", "missing"))


def _deliver_rpc(call: _Call, output_rank: int) -> None:
    ranks = sorted(call.replies)
    missing = [call.replies[r]["value"] for r in ranks if call.replies[r]["status"] == "missing"]
    if missing:
        fail_future(call.future, AttributeError(missing[0]))
    elif call.all_ranks:
        resolve_future(call.future, [call.replies[r]["value"] for r in ranks])
    else:
        resolve_future(call.future, call.replies[output_rank]["value"])


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
