"""A replica's request lanes: how a request reaches every rank of a Ray replica and replies come back.

One protocol, three lanes, chosen once when the replica starts (`request_transport`):

    IpcLane        (actors/ipc.py)       same-node Unix sockets, large tensors in shared memory
    CompiledLane   (actors/compiled.py)  one Ray Compiled Graph over the ranks
    ActorCallLane  (here)                one Ray actor call per rank and request (any node)

    lane.name                       "ipc" | "compiled" | "actor_calls"
    lane.prepare(payload)           serialize once, in the caller's thread (a bad payload fails here)
    lane.weight(payload)            what a prepared payload costs against max_batch_weight (descriptors)
    lane.max_batch_weight           the most one batch message may carry (None: no bound)
    lane.batch(payloads)            a batch's prepared payloads as one message
    lane.send(tag, LaneRequest)     to every rank, in order; never blocks (the executor's launch calls it)
    lane.in_flight, lane.capacity   messages at the ranks, and how many may be
    lane.close()

Replies go back to the executor (actors/ray_executor.py) through the callbacks each lane takes
(`LaneReplies`, actors/rank_group.py); the executor never asks which lane it has.

`BoundedLane`: what the socket and compiled lanes share on the sending side.

A lane holds at most `capacity` messages at the ranks; a message sent beyond that waits in the
backlog, in order, until a reply frees a slot, so `send` never blocks the caller. Subclasses make a
message with `_pack` (no lock held), write it with `_write` (lock held; it returns the error of a
message that could not be written, so that request fails alone) and report `in_flight`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from functools import partial
from typing import Any, Callable, Sequence

import ray

from actors.protocol import LaneRequest

logger = logging.getLogger(__name__)
_STOP = object()


class BoundedLane:
    name = ""

    def __init__(self, capacity: int, on_unsent: Callable[[Any, BaseException], None]) -> None:
        self.capacity = capacity
        self._on_unsent = on_unsent
        self._lock = threading.Lock()  # the writer end: send, backlog, and what the subclass guards with it
        self._backlog: deque[tuple[Any, LaneRequest]] = deque()  # beyond capacity, not yet written
        self._closed = False

    @property
    def in_flight(self) -> int:
        raise NotImplementedError

    def _pack(self, request: LaneRequest) -> Any:
        """The message of `request`, made before the lane's lock is taken (serializing, or copying a large
        body, never holds the writer end); raising fails that request alone."""
        return request

    def _write(self, tag: Any, packed: Any) -> BaseException | None:
        raise NotImplementedError

    def send(self, tag: Any, request: LaneRequest) -> None:
        """Write `request` (or keep it, in order, until there is room); never blocks."""
        try:
            packed = self._pack(request)
        except Exception as exc:
            self._on_unsent(tag, exc)
            return
        with self._lock:
            if self._backlog or self.in_flight >= self.capacity:
                self._backlog.append((tag, packed))
                return
            error = self._write(tag, packed)
        if error is not None:
            self._on_unsent(tag, error)

    def _flush_backlog(self) -> list[tuple[Any, BaseException]]:
        """Lock held: write backlog messages while there is room; the ones that did not serialize."""
        unsent = []
        while self._backlog and self.in_flight < self.capacity and not self._closed:
            tag, request = self._backlog.popleft()
            error = self._write(tag, request)
            if error is not None:
                unsent.append((tag, error))
        return unsent


class ActorCallLane:
    """Each request as one `RankActor.execute` call per rank (Ray orders them by sequence number on the
    rank); replies are handed from Ray's thread to this lane's own reply thread, never handled there."""

    name = "actor_calls"
    max_batch_weight = None
    capacity = 1 << 30  # bounded by the rank pipeline's max_ongoing_requests, not here

    def __init__(self, actors: Sequence[Any], *, name: str, on_reply: Callable[[Any, int, Any], None],
                 on_rank_error: Callable[[int, BaseException], None],
                 on_send_failed: Callable[[int, BaseException], None]) -> None:
        self._actors = list(actors)
        self._on_reply, self._on_rank_error, self._on_send_failed = on_reply, on_rank_error, on_send_failed
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[int, int] = {}  # seq -> ranks that have not replied yet
        threading.Thread(target=self._reply_loop, name=f"{name}-replies", daemon=True).start()

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    def prepare(self, payload: Any) -> Any:
        return ray.put(payload)  # once, shared by every rank's call

    def weight(self, payload: Any) -> int:
        return 0

    def batch(self, payloads: list) -> list:
        return list(payloads)

    def send(self, tag: Any, request: LaneRequest) -> None:
        replies = []
        try:
            for rank, actor in enumerate(self._actors):
                replies.append(actor.execute.remote(request.seq, request.kind, request.payload,
                                                    rank in request.reply_ranks))
        except BaseException as exc:  # some ranks have it, others not: the order is broken for good
            self._on_send_failed(len(replies), exc)
            return
        self._waiting[request.seq] = len(replies)
        for rank, reply in enumerate(replies):
            reply.future().add_done_callback(partial(self._post, tag, request.seq, rank))

    def _post(self, tag: Any, seq: int, rank: int, reply: Any) -> None:
        self._inbox.put((tag, seq, rank, reply))  # on Ray's thread: hand over, never block or call back

    def _reply_loop(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            tag, seq, rank, reply = item
            left = self._waiting.get(seq, 1) - 1
            if left > 0:
                self._waiting[seq] = left
            else:
                self._waiting.pop(seq, None)
            try:
                try:
                    envelope = reply.result()
                except BaseException as exc:
                    self._on_rank_error(rank, exc)
                    continue
                self._on_reply(tag, rank, envelope)
            except Exception:
                logger.exception("handling a rank reply failed")

    def close(self) -> None:
        self._inbox.put(_STOP)
