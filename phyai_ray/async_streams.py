"""`StreamPump`: an `Engine.stream` generator read from asyncio, safely.

    pump = StreamPump(engine.stream(request))      # on the event loop
    kind, value = await pump.get()                 # ("chunk", c) ... then ("end", result) or ("error", exc)
    items = await pump.get_ready()                 # the next item and all those already waiting
    pump.close()                                   # any time, from the loop: the stream is cancelled

Why not `await asyncio.to_thread(next, chunks)`: a pull waits for the next chunk inside the
default executor, so a few slow streams hold every thread of that small pool (min(32, cores + 4))
and every other `to_thread` of the app waits behind them; and a response cancelled during a pull
cannot close the generator (`ValueError: generator already executing`), so the stream kept its
replica slot until garbage collection. Here one thread of the pump's own pulls the generator and
is the only one that ever touches it: `close()` only raises a flag, and the pump thread closes the
generator (cancelling the stream on every rank) as soon as its pull in progress returns, at most
one chunk later. The pump runs at most `ahead` chunks ahead of the reader.

`stream_items(engine, request)` is what a route iterates: for a stream whose reader can wake it
(`reader.subscribe(wake)`: a stream produced in this process, by the iteration loop or an inline
rank) it needs no thread at all, so dozens of open streams do not put dozens of threads on the GIL
beside the engine; for the others (a Ray replica's output rank) it is a `StreamPump`. It opens the stream before its first item: a stream the engine refuses (no healthy
replica, a full queue) raises from the first `__anext__` and never appears as an item, so a caller
can tell "refused, nothing ran" (safe to send elsewhere) from a failure of a stream that started.

    async for items in stream_items(engine, request):    # lists of ("chunk" | "end" | "error", value)
        ...

`deadline_s` (seconds from the call): the stream's first chunk must come by then. It goes to
`Engine.open_stream` (the iteration loop admits the stream only if one iteration fits, and drops it
if no chunk came in time); whatever the replica, a stream with no item by then is cancelled here and
ends with ("error", DeadlineMissedError).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, AsyncIterator, Iterator

from phyai_ray.errors import DeadlineMissedError

_RECHECK_S = 1.0  # a threadless stream looks at its reader at least this often, woken or not


class StreamPump:
    def __init__(self, chunks: Iterator[Any], *, ahead: int = 8, name: str = "phyai-stream-pump") -> None:
        self._chunks = chunks
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._room = threading.Semaphore(ahead)
        self._closed = threading.Event()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    async def get(self) -> tuple[str, Any]:
        """The next item: ("chunk", chunk), then ("end", the stream's result) or ("error", exception)."""
        item = await self._queue.get()
        self._room.release()
        return item

    async def get_ready(self) -> list[tuple[str, Any]]:
        """The next item and every item already waiting behind it (one write for all of them: a reader
        slower than the stream gets fewer, larger writes instead of falling behind)."""
        items = [await self.get()]
        while items[-1][0] == "chunk" and not self._queue.empty():
            items.append(self._queue.get_nowait())
            self._room.release()
        return items

    def close(self) -> None:
        """Stop pulling; the generator is closed (the stream cancelled) by the pump's thread."""
        self._closed.set()
        self._room.release()  # a pump waiting for room wakes and sees the flag

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                if not self._room.acquire(timeout=1.0) or self._closed.is_set():
                    continue
                try:
                    item: tuple[str, Any] = ("chunk", next(self._chunks))
                except StopIteration as stop:
                    item = ("end", stop.value)
                except Exception as exc:
                    item = ("error", exc)
                self._put(item)
                if item[0] != "chunk":
                    return
        finally:
            self._chunks.close()  # on the only thread that ever runs the generator

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody reads any more
            self._closed.set()


async def stream_items(engine: Any, request: Any, *, session: Any = None, max_buffered: int = 64,
                       deadline_s: float | None = None) -> AsyncIterator[list[tuple[str, Any]]]:
    """Every item of `engine`'s stream of `request`, in lists of those ready together; leaving early
    (closing the generator) cancels the stream. Threadless when its reader can wake us (`subscribe`).
    `deadline_s`: its first item by then (see the module docstring)."""
    first_by = None if deadline_s is None else time.monotonic() + deadline_s
    extra = {} if deadline_s is None else {"deadline_s": deadline_s}  # any engine with open_stream serves without
    opening = asyncio.ensure_future(asyncio.to_thread(
        lambda: engine.open_stream(request, session=session, max_buffered=max_buffered, **extra)))
    try:
        future, reader = await asyncio.shield(opening)
    except asyncio.CancelledError:  # the reader left while the stream opened: cancel it once it is open
        opening.add_done_callback(lambda t: None if t.cancelled() or t.exception() else t.result()[1].cancel())
        raise
    loop, woken, done = asyncio.get_running_loop(), asyncio.Event(), False

    def poke() -> None:  # on the engine's thread
        try:
            loop.call_soon_threadsafe(woken.set)
        except RuntimeError:  # the loop is closed: nobody reads any more
            pass
    if not reader.subscribe(poke):  # a reader that only blocks: a pump with a thread of its own
        async for items in _pumped(engine.read_stream(future, reader), first_by, deadline_s):
            yield items
        return
    try:
        while True:
            woken.clear()
            chunks, done = reader.read(0.0)
            done = done and future.done()  # its outcome is what ends the stream (it wakes us when set)
            if future.done() and (future.cancelled() or future.exception() is not None):
                done = True  # a failure ends it even if its sink was never closed: no reader waits forever
            items: list[tuple[str, Any]] = [("chunk", c) for c in chunks]
            if done:
                if future.cancelled():
                    return
                error = future.exception()
                items.append(("error", error) if error is not None else ("end", future.result()))
                yield items
                return
            if items:
                first_by = None
                yield items
            elif first_by is not None and time.monotonic() >= first_by:
                yield [("error", first_chunk_late(deadline_s))]  # `finally` cancels the stream
                return
            wait_s = _RECHECK_S if first_by is None else min(_RECHECK_S, max(first_by - time.monotonic(), 0.0))
            try:
                await asyncio.wait_for(woken.wait(), timeout=wait_s)
            except asyncio.TimeoutError:
                pass
    finally:
        if not done:
            reader.cancel()


def first_chunk_late(deadline_s: float) -> DeadlineMissedError:
    """The answer to a stream that gave no item within its own deadline (`deadline_s`)."""
    return DeadlineMissedError(f"the stream's deadline ({deadline_s * 1e3:.1f} ms) passed before its first chunk; "
                               "the stream was cancelled. Give it a later deadline, or add replicas or lower the load",
                               waited_s=deadline_s, deadline_s=deadline_s)


async def _pumped(chunks: Iterator[Any], first_by: float | None = None,
                  deadline_s: float | None = None) -> AsyncIterator[list[tuple[str, Any]]]:
    pump = StreamPump(chunks, name="phyai-stream-pump")
    try:
        if first_by is not None:  # its first item by then, else it ends missed (closing the pump cancels it)
            try:
                items = await asyncio.wait_for(pump.get_ready(), timeout=max(first_by - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                yield [("error", first_chunk_late(deadline_s))]
                return
            yield items
            if items[-1][0] != "chunk":
                return
        while True:
            items = await pump.get_ready()
            yield items
            if items[-1][0] != "chunk":
                return
    finally:
        pump.close()
