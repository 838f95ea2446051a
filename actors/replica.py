"""`RayReplicaExecutor`: one replica = one placement group of rank actors forming a process group.

Request path: the request is serialized once (`ray.put`, in the caller's thread, before it is
queued), waits in the replica's engine-side scheduler, and when a slot is free the same reference
goes to every rank with the next sequence number; every rank runs requests in sequence order, and
the output rank's reply resolves the future. Replies are handed from Ray's threads to this
replica's reply thread, which never runs user code (done-callbacks run on the engine's callback
thread), so a callback may call the engine again.

Fail-fast: a rank that dies (noticed by its pending replies or a ping on the control lane every
`liveness_interval_s`), raises, replies malformed, runs one request past its limit, or cannot be
sent a request fails the whole replica: it is marked unavailable first, every queued and
dispatched request fails with `EngineUnavailableError` naming the cause, then every rank is killed
and the placement group removed. Nothing is retried or restarted here.
"""

from __future__ import annotations

import logging
import os
import queue
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
from actors.protocol import MISSING, ActorInfo, RankReply, RankSpec
from actors.rank_actor import CONCURRENCY_GROUPS, RankActor
from actors.startup import gather_within
from phyai_ray.errors import EngineUnavailableError, StartupError
from phyai_ray.executors.base import ReplicaExecutor
from phyai_ray.executors.scheduler import Work
from placement.bundles import ReplicaPlan
from placement.spread import physical_device
from placement.topology import Topology

logger = logging.getLogger(__name__)
RemoteRank = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RankActor)
_STOP = object()


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
        self._teardown_lock = threading.Lock()
        self._seq = 0
        self._pg, self._actors, self._infos = None, [], []
        self._owned_pg = True  # False when the ranks run in a placement group someone else owns
        self._torn_down = False
        self._stop = threading.Event()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        try:
            self._start(plan, entry, args, deployment, device_type, target_node, deadline)
        except BaseException:
            self._teardown()
            raise
        for target, what in ((self._reply_loop, "replies"), (self._liveness_loop, "liveness")):
            threading.Thread(target=target, name=f"phyai-replica-{plan.index}-{what}", daemon=True).start()

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
        gather_within([a.setup.remote(s) for a, s in zip(self._actors, specs)], deadline, self.index,
                      "start (process groups and plugin create)", nodes=[i.node_id for i in self._infos])
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
                        collective_timeout_s=self._proc.collective_timeout_s)

    # -- requests ---------------------------------------------------------------------------
    def _prepare(self, payload: Any) -> Any:
        return ray.put(payload)  # once, before a slot or sequence number is taken: a bad payload loses nothing

    def _launch(self, work: Work) -> None:
        """Send `work` to every rank with the next sequence number, or fail the replica at once."""
        sent = _Sent(self._seq, set(range(self.world_size)))
        self._seq += 1
        work.state = sent
        replies = []
        try:
            for rank, actor in enumerate(self._actors):
                wants = rank == self._output_rank or (work.kind == "call" and work.all_ranks)
                replies.append(actor.execute.remote(sent.seq, work.kind, work.payload, wants))
        except BaseException as exc:  # some ranks have it, others not: the order is broken for good
            self._fail(self._send_error(len(replies), exc))
            return
        for rank, reply in enumerate(replies):
            reply.future().add_done_callback(partial(self._post_reply, work, rank))

    def _submit_stream(self, request: Any, max_buffered: int) -> tuple[Future, Any]:
        future = self.scheduler.submit("stream", self._prepare((request, max_buffered)), self._step_limit_s)
        return future, RemoteReader(self, future.work)

    def _post_reply(self, work: Work, rank: int, reply: Future) -> None:
        self._inbox.put((work, rank, reply))  # on Ray's thread: hand over, never block or call back

    def _reply_loop(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            try:
                self._on_reply(*item)
            except Exception:
                logger.exception("replica %d: handling a rank reply failed", self.index)

    def _on_reply(self, work: Work, rank: int, reply: Future) -> None:
        try:
            envelope = reply.result()
        except BaseException as exc:
            self._fail(self._rank_error(rank, exc))
            return
        sent: _Sent = work.state
        if not isinstance(envelope, RankReply) or not envelope.matches(sent.seq, rank):
            self._fail(EngineUnavailableError(
                f"replica {self.index} rank {rank} sent a malformed reply to request {sent.seq}: {envelope!r:.200}",
                reason="malformed", replica=self.index, rank=rank, node=self._node(rank)))
            return
        sent.replies[rank] = envelope
        sent.pending.discard(rank)
        if work.kind in ("step", "stream") and rank == self._output_rank:
            self.scheduler.deliver(work, envelope.value)
        if not sent.pending:
            if work.kind == "call":
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
            self.scheduler.stop(self.unavailable_error, cancel_queued=True)
        self._teardown()

    def _teardown(self) -> None:
        """Kill every rank (never rely on cancel: a rank may sit in a collective), remove the group."""
        with self._teardown_lock:
            if self._torn_down:
                return
            self._torn_down = True
        self._stop.set()
        self._inbox.put(_STOP)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                logger.debug("kill rank actor: %s", exc)
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


class RemoteReader:
    """The consumer's end of a stream produced by the output rank of a Ray replica (its control lane)."""

    def __init__(self, executor: RayReplicaExecutor, work: Work) -> None:
        self.executor, self.work = executor, work
        self._sink = executor.actor(executor._output_rank)

    def read(self, timeout_s: float) -> tuple[list, bool]:
        if self.work.future.cancelled():
            return [], True
        sent = self.work.state
        if sent is None:  # still queued in the engine
            time.sleep(min(timeout_s, 0.01))
            return [], False
        try:
            return ray.get(self._sink.read_stream.remote(sent.seq, 64, timeout_s), timeout=timeout_s + 10)
        except Exception:  # the replica failed: the future says why
            return [], self.work.future.done()

    def cancel(self) -> None:
        if self.work.future.cancel():
            return
        sent = self.work.state
        if sent is not None and self.executor.healthy:
            self._sink.cancel_stream.remote(sent.seq)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
