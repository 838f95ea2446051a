"""`RayExecutor`: a replica's ranks as one placement group of rank actors forming a process group.

    replica = ScheduledReplica(RayExecutor(plan, ...), index=plan.index, ...)   (actors/launch.py)

The executor of a Ray replica (vLLM's and the design's word: what runs a replica's ranks; the inline
and external ones live in phyai_ray/executors/). It is three parts, each given what it uses:

    RankGroup   actors/rank_group.py    the placement group and rank actors; how they start; the lane
    RankHealth  actors/rank_health.py   dead and stuck ranks, the errors that name them
    RayExecutor here                    sending work, reading replies, control ops, teardown

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
queue until the rank pipeline has a slot, the output rank's reply resolves the future, and no thread of the
request path runs user code (done-callbacks run on the engine's callback thread), so a callback
may call the engine again. Liveness pings always use normal actor calls on the ranks' control lane.

A request's failure is its own: an iteration's sequences that failed alone (their `admit` raised, or
`SequenceError`; phyai_ray/rank/failures.py) come back in the ranks' replies, and when every rank names
the same sequences with the same exception types, only those requests fail (the output rank's reply
carries their errors) and the ranks keep serving. Ranks that name different ones have diverged.

Fail-fast: a rank that dies (noticed by its pending replies or a ping on the control lane every
`liveness_interval_s`), raises (outside a sequence of its own), replies malformed, disagrees with the
others about which sequences failed, runs one call past its hang limit, or cannot be sent a request
fails the whole replica: it is marked unavailable first, every queued and
dispatched request fails with `EngineUnavailableError` naming the cause, then every rank is killed
and the placement group removed. Nothing is retried or restarted here. Every part reports a failure
through `_fail`, the one failure path.

The executor owns its ranks; the replica (phyai_ray/executors/base.py) owns the queue, the rank pipeline
and the lifecycle, and hears back only through the `ReplicaLink` it binds.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray

from actors import fetch
from actors.compiled import CompiledLane
from actors.ipc import IpcLane
from actors.lane import ActorCallLane
from actors.protocol import ERROR, MISSING, LaneRequest, RankReply
from actors.rank_group import LaneReplies, RankGroup, open_lane, start_group
from actors.rank_health import RankHealth
from actors.remote_streams import RemoteReader
from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.replica import ReplicaLink, rank_args
from phyai_ray.plugins.iteration import RankIteration
from phyai_ray.work import BATCH, CALL, ITERATE, Work
from placement.bundles import ReplicaPlan
from placement.topology import Topology


@dataclass
class _Sent:
    """Which ranks still owe a reply for one dispatched request or rpc."""

    seq: int
    pending: set[int]
    replies: dict[int, RankReply] = field(default_factory=dict)


class RayExecutor:
    """The ranks of one replica as Ray actors in one placement group (an `Executor`)."""

    runs_here = False
    lockstep = False

    def __init__(self, plan: ReplicaPlan, *, entry: Any, args: Any, deployment: Any, device_type: str,
                 target_node: str | None, deadline: float) -> None:
        proc = deployment.process_config
        self.index, self.world_size = plan.index, plan.world_size
        self.output_rank = Topology.from_parallel(args.config.parallel).output_rank
        self._link: ReplicaLink | None = None
        self.group = RankGroup(plan.index)  # filled in as the ranks start: a failed start releases what is there
        self.health = RankHealth(self.group, interval_s=proc.liveness_interval_s, fail=self._fail,
                                 failed=lambda: self._failure is not None)
        self._teardown_lock = threading.Lock()
        self._seq = 0
        self._torn_down = False
        self._lane: IpcLane | CompiledLane | ActorCallLane | None = None  # set once the ranks are up
        try:
            start_group(self.group, plan, entry=entry, args=args, deployment=deployment, device_type=device_type,
                        target_node=target_node, deadline=deadline)
            self._lane = open_lane(self.group, proc, deadline, self._lane_replies())
        except BaseException:
            self._teardown()
            raise
        self.batchable, self.iterative = self.group.batchable, self.group.iterative

    def _lane_replies(self) -> LaneReplies:
        """Where the lane hands replies (here) and broken ranks (to health, which names them)."""
        return LaneReplies(
            on_reply=self._on_lane_reply, on_replies=self._on_compiled_replies, on_unsent=self._on_unsent,
            on_socket_broken=self.health.on_socket_broken, on_lane_broken=self.health.on_lane_broken,
            on_rank_error=lambda rank, exc: self._fail(self.health.rank_error(rank, exc)),
            on_send_failed=lambda rank, exc: self._fail(self.health.send_error(rank, exc)))

    def bind(self, link: ReplicaLink) -> None:
        """Where replies go; the liveness pings start now."""
        self._link = link
        self.health.watch()

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
        """Fail the replica (the one failure path of every part); before it is bound, only release the ranks."""
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
        every = (work.kind == CALL and work.all_ranks) or work.kind == ITERATE  # an iteration: failed sequences
        reply_ranks = frozenset(range(self.world_size)) if every else frozenset((self.output_rank,))
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
            self._fail(self.health.rank_error(rank, envelope.value))
            return
        if not isinstance(envelope, RankReply) or not envelope.matches(sent.seq, rank):
            self._fail(EngineUnavailableError(
                f"replica {self.index} rank {rank} sent a malformed reply to request {sent.seq}: {envelope!r:.200}",
                reason="malformed", replica=self.index, rank=rank, node=self.group.node(rank)))
            return
        sent.replies[rank] = envelope
        sent.pending.discard(rank)
        if work.kind == ITERATE:
            if not self._on_iteration(work, sent, rank):
                return
        elif work.kind != CALL and rank == self.output_rank:
            self._link.deliver(work, envelope.value)
        if not sent.pending:
            if work.kind == CALL:
                self._deliver_rpc(work, sent)
            self._link.finished(work)

    def _on_iteration(self, work: Work, sent: _Sent, rank: int) -> bool:
        """An iteration's reply from `rank`: the output rank's is delivered at once when it names no failed
        sequence, else once every rank agreed on the same ones; ranks that disagree fail the replica (False)."""
        value = sent.replies[rank].value
        if rank == self.output_rank and not _failed_kinds(value):
            self._link.deliver(work, value)
        if sent.pending:
            return True
        kinds = {r: _failed_kinds(reply.value) for r, reply in sorted(sent.replies.items())}
        if any(k != kinds[self.output_rank] for k in kinds.values()):
            self._fail(self.health.disagreement(kinds))
            return False
        if kinds[self.output_rank]:
            self._link.deliver(work, sent.replies[self.output_rank].value)
        return True

    def _deliver_rpc(self, work: Work, sent: _Sent) -> None:
        ranks = sorted(sent.replies)
        missing = [sent.replies[r].value for r in ranks if sent.replies[r].status == MISSING]
        if missing:
            self._link.deliver(work, error=AttributeError(missing[0]))
        elif work.all_ranks:
            self._link.deliver(work, [sent.replies[r].value for r in ranks])
        else:
            self._link.deliver(work, sent.replies[self.output_rank].value)

    def control(self, op: str, args: tuple, timeout_s: float) -> Future:
        """Run control op `op` on every rank's control lane (a thread gathers the replies)."""
        refs = [actor.control.remote(op, rank_args(op, args, rank, self.world_size))
                for rank, actor in enumerate(self.group.actors)]
        future: Future = Future()

        def gather() -> None:
            try:
                future.set_result(fetch.get(refs, timeout=timeout_s))
            except ray.exceptions.GetTimeoutError:
                future.set_exception(TimeoutError(
                    f"control op {op!r} got no reply from every rank in {timeout_s:.1f}s"))
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
        """Stop the pings, kill every rank (never rely on cancel: a rank may sit in a collective), close the
        lane, remove the group."""
        with self._teardown_lock:
            if self._torn_down:
                return
            self._torn_down = True
        self.health.stop()
        self.group.kill()
        if self._lane is not None:
            self._lane.close()  # after the kills: a rank stuck in a step cannot hold the teardown up
        self.group.remove()

    def hang_detail(self, work: Work) -> tuple[int | None, str | None, str]:
        return self.health.hang_detail(work)

    def nodes(self) -> tuple[str, ...]:
        return tuple(i.node_id for i in self.group.infos)

    def pids(self) -> tuple[int, ...]:
        return tuple(i.pid for i in self.group.infos)

    def actor(self, rank: int) -> Any:
        return self.group.actors[rank]


def _failed_kinds(value: Any) -> dict[int, str]:
    """{seq_id: exception type name} of the sequences a rank's iteration reply says failed alone."""
    return value.kinds if isinstance(value, RankIteration) else {}
