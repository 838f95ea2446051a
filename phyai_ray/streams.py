"""Streaming partial outputs from the output rank while a request runs.

    for chunk in engine.stream({"prompts": [[1, 2, 3]], "max_tokens": 64}):   # one chunk per token step
        ...                       # leaving the loop early cancels: every rank stops at the same step

A plugin streams by defining `stream(request, emit)` on its per-rank model: it calls `emit(chunk)`
as partial outputs appear and stops when `emit` returns False; its return value is the request's
result. `emit` is collective: every rank of the replica calls it the same number of times, and it
returns the same answer on every rank (the output rank's "consumer stopped" flag is all-reduced
over the replica), so ranks that share collectives stop together. Only the output rank's chunks
are kept. At most `max_buffered` chunks wait unread; past that the plugin blocks in `emit` until
the consumer reads (a consumer that stops reading for `execution_timeout_s` makes the replica hang
and fail, as any request running that long would).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

DEFAULT_MAX_BUFFERED = 64


class ChunkSink:
    """A bounded, cancellable queue of chunks between a producing rank and one consumer."""

    def __init__(self, max_buffered: int = DEFAULT_MAX_BUFFERED,
                 merge: Callable[[Any, Any], Any] | None = None) -> None:
        """`merge(last, chunk)`: a producer that must never wait (the iteration loop runs every sequence)
        folds a chunk into the last one once `max_buffered` wait, instead of blocking: a slow reader
        gets fewer, larger chunks, and the buffer stays `max_buffered` chunks long."""
        self.max_buffered, self._merge = max_buffered, merge
        self._chunks: deque = deque()
        self._cond = threading.Condition()
        self.cancelled = self.closed = False
        self._then: Callable[[], None] | None = None  # runs once a cancelled sink is closed
        self.on_change: Callable[[], None] | None = None  # called after each put and at close (no lock held)

    def put(self, chunk: Any) -> bool:
        """Add a chunk, waiting while the buffer is full; False once the consumer cancelled."""
        with self._cond:
            while len(self._chunks) >= self.max_buffered and not self.cancelled and self._merge is None:
                self._cond.wait(timeout=1.0)
            if self.cancelled:
                return False
            if self._chunks and len(self._chunks) >= self.max_buffered:
                self._chunks[-1] = self._merge(self._chunks[-1], chunk)
            else:
                self._chunks.append(chunk)
            self._cond.notify_all()
            poke = self.on_change
        if poke is not None:
            poke()
        return True

    def take(self, max_items: int, timeout_s: float) -> tuple[list, bool]:
        """Up to `max_items` chunks (waiting up to `timeout_s` for the first); True once closed and drained."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._chunks and not self.closed and time.monotonic() < deadline:
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0))
            items = [self._chunks.popleft() for _ in range(min(max_items, len(self._chunks)))]
            self._cond.notify_all()
            return items, self.closed and not self._chunks

    def put_last(self, chunk: Any) -> bool:
        """Add the stream's final chunk past `max_buffered` and never folded into another (a value
        stream's result); False once the consumer cancelled."""
        with self._cond:
            if self.cancelled:
                return False
            self._chunks.append(chunk)
            self._cond.notify_all()
            poke = self.on_change
        if poke is not None:
            poke()
        return True

    def close(self) -> None:
        with self._cond:
            self.closed = True
            then, self._then = self._then, None
            self._cond.notify_all()
            poke = self.on_change
        if then is not None:
            then()
        if poke is not None:
            poke()

    def cancel(self, then: Callable[[], None] | None = None) -> None:
        """Drop what is buffered; the producer's next `put` returns False. `then` runs once the
        producer has closed the sink (at once, if it already has): the owner forgets it there."""
        with self._cond:
            self.cancelled = True
            self._chunks.clear()
            self._cond.notify_all()
            closed = self.closed
            if not closed:
                self._then = then
        if closed and then is not None:
            then()


class LocalReader:
    """The consumer's end of a stream produced in this process (an inline rank, or the iteration loop).

    Every reader (this one, and `actors.remote_streams.RemoteReader` for a Ray replica) answers:
        read(timeout_s) -> (chunks, done)   what is there, waiting up to timeout_s for the first
        subscribe(wake) -> bool             call `wake()` (no lock held, never blocking) after each chunk,
                                            at the end and when the request settles; False: it cannot,
                                            so a consumer pulls from a thread of its own
        cancel()                            drop the request (a cancelled future), else stop the producer
                                            at its next put
    """

    def __init__(self, sink: ChunkSink, future: Any) -> None:
        self.sink, self.future = sink, future

    def subscribe(self, wake: Callable[[], None]) -> bool:
        self.sink.on_change = wake
        hand_off = getattr(self.future, "add_loop_callback", self.future.add_done_callback)
        hand_off(lambda _: wake())  # the sink may close before the future settles (an inline rank)
        return True

    def read(self, timeout_s: float) -> tuple[list, bool]:
        if self.future.cancelled():
            return [], True
        chunks, done = self.sink.take(64, timeout_s)
        return chunks, done or (self.future.done() and not chunks and self.sink.closed)

    def cancel(self) -> None:
        if not self.future.cancel():
            self.sink.cancel()


def collective_emit(sink: ChunkSink | None, ctx: Any) -> Any:
    """The `emit(chunk) -> bool` a plugin's `stream` gets on one rank (see the module docstring)."""
    def emit(chunk: Any) -> bool:
        stop = sink is not None and ctx.is_output_rank and not sink.put(chunk)
        if ctx.world_size > 1:
            import torch

            from phyai_ray.collectives import P

            stop = bool(P.all_reduce(torch.tensor([int(stop)]), "world", op="max").item())
        return not stop
    return emit
