"""`CompiledLane`: a replica's request path over one Ray Compiled Graph.

    driver --LaneRequest--> [shared-memory input channel, read by every rank]
           <--RankReply x world-- [one output channel per rank] <-- RankActor.run_compiled

The graph is `InputNode -> rank_i.run_compiled -> MultiOutputNode` over the replica's ranks. A
request is written once into a channel every rank reads (no copy per rank); each rank's reply
comes back through its own channel; the lane's reader thread takes the replies in order and hands
them to `on_replies`. Ray runs each rank's side on the actor's "_ray_system" thread, so the
actor's event loop and its "control" concurrency group (liveness pings) stay free.

Bounded: the graph holds `capacity` messages (one shared-memory buffer each); a message sent beyond
it waits in the lane's backlog, in order, until a reply frees a slot, so a write never blocks the
caller. Thread use: `send` is called by one thread at a time, in dispatch order (the rank pipeline's
`send_launches`, outside the replica's lock), and writes; the reader thread reads, and writes the
backlog under the lane's lock; callbacks run outside the lane's lock. (Ray calls a graph's `execute`
"not thread-safe": it is only ever called under the lane's lock here, and every reply is read, in
order, by the one reader, so the graph's release of unread buffers, the one path where writing
touches the reader's state, never runs.)

Failure: a write that fails before anything was written (the payload does not serialize) fails
that request alone; a closed channel or a failed graph ends the reader with `on_broken(exc)`; the
executor then finds the cause (which rank died) and fails the replica.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable, Sequence

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.exceptions import RayChannelError

from actors.lane import BoundedLane
from actors.protocol import LaneRequest

logger = logging.getLogger(__name__)


class _KilledRankNoise(logging.Filter):
    """Ray's graph teardown logs a traceback for each rank it cannot cancel because it was killed;
    the lane kills ranks before tearing the graph down on purpose (a rank may be stuck in a step)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage() == "Error cancelling worker task"
                    and isinstance(exc, ray.exceptions.RayActorError))


logging.getLogger("ray.dag.compiled_dag_node").addFilter(_KilledRankNoise())

_BUFFER_BYTES = 1 << 20  # initial size of each channel buffer; a larger message grows its buffer
_STOP = object()


BY_REFERENCE_BYTES = 1 << 20  # requests with more tensor bytes than this go as one ray.put reference


class CompiledLane(BoundedLane):
    """Send `LaneRequest`s to every rank of one replica and read their replies, in order."""

    name = "compiled"
    max_batch_weight = None

    def prepare(self, payload: Any) -> Any:
        """Small payloads go by value through the channel (written once for every rank); large ones as one
        `ray.put` reference, put here, in the caller's thread."""
        return ray.put(payload) if _tensor_bytes(payload) > BY_REFERENCE_BYTES else payload

    def weight(self, payload: Any) -> int:
        return 0

    def batch(self, payloads: list) -> list:
        return list(payloads)

    def __init__(self, actors: Sequence[Any], *, capacity: int, name: str,
                 on_replies: Callable[[Any, list], None], on_broken: Callable[[BaseException], None],
                 on_unsent: Callable[[Any, BaseException], None]) -> None:
        super().__init__(capacity, on_unsent)
        self._on_replies, self._on_broken = on_replies, on_broken
        with InputNode() as request:
            graph = MultiOutputNode([actor.run_compiled.bind(request) for actor in actors])
        self._dag = graph.experimental_compile(_max_inflight_executions=capacity, _buffer_size_bytes=_BUFFER_BYTES)
        self._sent: deque[tuple[Any, list]] = deque()  # (tag, refs) written, reply not yet read
        self._ready = threading.Condition(self._lock)
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-compiled-replies", daemon=True)
        self._reader.start()

    @property
    def in_flight(self) -> int:
        """Messages written to the graph whose replies are not yet read (this one counted once sent)."""
        return len(self._sent)

    def _write(self, tag: Any, request: LaneRequest) -> BaseException | None:
        """Lock held. Returns the error of a request that did not serialize (nothing was written)."""
        if self._closed:
            return None
        try:
            refs = self._dag.execute(request)
        except RayChannelError as exc:  # torn down under us: the reader reports the cause
            logger.debug("compiled graph closed while sending: %s", exc)
            return None
        except Exception as exc:
            return exc
        self._sent.append((tag, refs))
        self._ready.notify()
        return None

    def _read_loop(self) -> None:
        while True:
            with self._lock:
                while not self._sent and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                tag, refs = self._sent[0]
            try:
                replies = ray.get(refs, timeout=-1)  # -1: until the reply or the graph's teardown
            except BaseException as exc:
                if not self._closed:
                    self._on_broken(exc)
                return
            with self._lock:
                self._sent.popleft()
                unsent = self._flush_backlog()
            try:
                self._on_replies(tag, replies)
                for item in unsent:
                    self._on_unsent(*item)
            except Exception:
                logger.exception("handling compiled-graph replies failed")

    def close(self) -> None:
        """Stop reading and tear the graph down (after the ranks were killed, this takes milliseconds)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ready.notify_all()
        try:
            self._dag.teardown()
        except Exception as exc:  # already torn down by Ray's monitor after a rank died
            logger.debug("compiled graph teardown: %s", exc)


def _tensor_bytes(payload: Any) -> int:
    """Bytes of the tensors in `payload` and in the values of its top-level dict / list / tuple."""
    items = payload.values() if isinstance(payload, dict) else payload if isinstance(payload, (list, tuple)) else ()
    total = 0
    for value in (payload, *items):
        nbytes = getattr(value, "nbytes", None)
        if isinstance(nbytes, int):
            total += nbytes
    return total
