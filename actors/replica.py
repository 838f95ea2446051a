"""`RayTransport`: a replica's ranks as one placement group of rank actors forming a process group.

    replica = ScheduledReplica(RayTransport(plan, ...), index=plan.index, ...)   (actors/launch.py)

Request path (`WorkerSupervisorConfig.request_transport`). Same-node sockets (`auto` picks them
where every rank is on the engine's node): `actors.ipc.IpcLane` writes each dispatched request,
pickled once in the caller's thread with its large tensors in shared memory, to one Unix socket
per rank; each rank's request thread runs them in order and writes its reply back; waiting threads
block in the kernel, so idle replicas use no CPU. Actor calls (the fallback, e.g. across nodes):
the request is serialized once (`ray.put`, in the caller's thread, before it is queued) and the
same reference goes to every rank with the next sequence number; every rank runs requests in
sequence order; replies are handed from Ray's threads to that lane's reply thread. Compiled
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

The transport owns its ranks; the replica (phyai_ray/executors/base.py) owns the queue, the scheduler
and the lifecycle, and hears back only through the `ReplicaLink` it binds. Here: sending work and
reading replies. How the ranks start: `replica_start.py`; how a dead or stuck rank is noticed and
named: `replica_health.py` (both parts of this transport); the lanes: `lane.py`.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray

from actors import fetch
from actors.compiled import CompiledLane
from actors.ipc import IpcLane
from actors.lane import ActorCallLane
from actors.placement_groups import remove_group
from actors.protocol import ERROR, MISSING, LaneRequest, RankReply
from actors.remote_streams import RemoteReader
from actors.replica_health import ReplicaHealth
from actors.replica_start import ReplicaStartup
from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.replica import ReplicaLink, rank_args
from phyai_ray.work import BATCH, CALL, Work
from placement.bundles import ReplicaPlan
from placement.topology import Topology

logger = logging.getLogger(__name__)


@dataclass
class _Sent:
    """Which ranks still owe a reply for one dispatched request or rpc."""

    seq: int
    pending: set[int]
    replies: dict[int, RankReply] = field(default_factory=dict)


class RayTransport(ReplicaStartup, ReplicaHealth):
    """The ranks of one replica as Ray actors in one placement group (a `RankTransport`)."""

    runs_here = False
    lockstep = False

    def __init__(self, plan: ReplicaPlan, *, entry: Any, args: Any, deployment: Any, device_type: str,
                 target_node: str | None, deadline: float) -> None:
        self._proc = deployment.process_config
        self.index, self.world_size = plan.index, plan.world_size
        self._link: ReplicaLink | None = None
        self._output_rank = Topology.from_parallel(args.config.parallel).output_rank
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
        self.batchable, self.iterative = self._batchable, self._iterative

    def bind(self, link: ReplicaLink) -> None:
        """Where replies go; the liveness pings start now."""
        self._link = link
        threading.Thread(target=self._liveness_loop, name=f"phyai-replica-{self.index}-liveness", daemon=True).start()

    @property
    def name(self) -> str:
        """How requests reach the ranks: "ipc" (same-node sockets), "compiled" (a Ray Compiled Graph)
        or "actor_calls" (actors/lane.py)."""
        return self._lane.name

    @property
    def _failure(self) -> Any:
        """The replica's failure (None while it serves, and before it is bound)."""
        return self._link.failure() if self._link is not None else None

    @property
    def healthy(self) -> bool:
        return self._failure is None

    def _fail(self, error: Any) -> None:
        """Fail the replica (its one failure path); before it is bound, only release the ranks."""
        if self._link is not None:
            self._link.fail(error)
        else:
            self.abandon()

    # -- requests ---------------------------------------------------------------------------
    def prepare(self, payload: Any) -> Any:
        """Serialize once, in the caller's thread, before a slot or sequence number is taken (a bad
        payload loses nothing): the lane's own form (see actors/lane.py)."""
        return self._lane.prepare(payload)

    def weight(self, prepared: Any) -> int:
        return self._lane.weight(prepared)

    @property
    def max_batch_weight(self) -> int | None:
        return self._lane.max_batch_weight

    def _lane_payload(self, work: Work) -> Any:
        """A batch's payloads as one message of the lane's; any other work's payload as it is."""
        return self._lane.batch(work.payload) if work.kind == BATCH else work.payload

    def launch(self, work: Work) -> None:
        """Send `work` to every rank with the next sequence number, or fail the replica at once."""
        sent = _Sent(self._seq, set(range(self.world_size)))
        self._seq += 1
        work.state = sent
        if work.launched is not None:  # a stream's reader waits for it (see stream)
            work.launched.set()
        reply_ranks = frozenset(range(self.world_size)) if work.kind == CALL and work.all_ranks else \
            frozenset((self._output_rank,))
        window = min(self._lane.in_flight + 1, self._lane.capacity)
        self._lane.send(work, LaneRequest(sent.seq, work.kind, self._lane_payload(work), reply_ranks, window))

    def run_here(self, work: Work) -> None:
        raise TypeError("a Ray replica's ranks run in their own processes; nothing runs on the caller's thread")

    def stream(self, request: Any, max_buffered: int) -> tuple[Any, Any]:
        """The streamed request's payload, and its reader: it pulls chunks from the output rank."""
        return self.prepare((request, max_buffered)), self._reader

    def _reader(self, future: Future) -> RemoteReader:
        work = future.work
        work.launched = threading.Event()
        if work.state is not None:  # launched before the event was there
            work.launched.set()
        return RemoteReader(self, work)

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

    def _on_unsent(self, work: Work, exc: BaseException) -> None:
        """The request did not serialize: nothing reached a rank, so it fails alone."""
        self._link.deliver(work, error=exc)
        self._link.finished(work)

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
        if work.kind != CALL and rank == self._output_rank:
            self._link.deliver(work, envelope.value)
        if not sent.pending:
            if work.kind == CALL:
                self._deliver_rpc(work, sent)
            self._link.finished(work)

    def _deliver_rpc(self, work: Work, sent: _Sent) -> None:
        ranks = sorted(sent.replies)
        missing = [sent.replies[r].value for r in ranks if sent.replies[r].status == MISSING]
        if missing:
            self._link.deliver(work, error=AttributeError(missing[0]))
        elif work.all_ranks:
            self._link.deliver(work, [sent.replies[r].value for r in ranks])
        else:
            self._link.deliver(work, sent.replies[self._output_rank].value)

    def control(self, op: str, args: tuple, timeout_s: float) -> Future:
        """Run control op `op` on every rank's control lane (a thread gathers the replies)."""
        refs = [actor.control.remote(op, rank_args(op, args, rank, self.world_size))
                for rank, actor in enumerate(self._actors)]
        future: Future = Future()

        def gather() -> None:
            try:
                future.set_result(fetch.get(refs, timeout=timeout_s))
            except ray.exceptions.GetTimeoutError:
                future.set_exception(TimeoutError(f"control op {op!r} got no reply from every rank in {timeout_s:.1f}s"))
            except BaseException as exc:
                future.set_exception(exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause else exc)
        threading.Thread(target=gather, name=f"phyai-replica-{self.index}-control", daemon=True).start()
        return future

    # -- releasing the ranks ----------------------------------------------------------------
    def abandon(self) -> None:
        """After a failure: kill the ranks on a thread of its own (a caller never waits for it)."""
        threading.Thread(target=self._teardown, name=f"phyai-replica-{self.index}-teardown", daemon=True).start()

    def close(self, drain: bool) -> None:
        """Kill the ranks now (a rank in a collective cannot finish alone, so nothing is drained)."""
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
