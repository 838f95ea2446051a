"""Futures whose done-callbacks run on a thread of the engine's own.

A result is set by whatever thread learns it (a Ray reply thread, the plugin's thread); waiters
(`result()`, `wait()`) wake at once. User done-callbacks are handed to a `CallbackThread` instead of
running on the setting thread, so a callback may call the engine again (even `engine.step()`):
the reply it waits for is set by another thread, never by the one the callback occupies.

Isolation: a callback that raises anything (`SystemExit` included) is logged and delivery goes
on. A callback that runs longer than `STALL_S` keeps its thread, and the callbacks after it move
to a fresh one, so one blocking callback delays the others of its replica by at most `STALL_S`.
asyncio waiters that use `awaitable(future)` (Serve's group runner and `EngineActor` do) do not
queue behind user callbacks at all: their hand-off only schedules the loop (`call_soon_threadsafe`),
so it runs on the setting thread. A plain `asyncio.wrap_future` is a user callback like any other.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

logger = logging.getLogger(__name__)

STALL_S = 2.0  # a callback running this long no longer holds up the ones after it


class CallbackThread:
    """Runs posted callbacks in order on one daemon thread that exits when idle (see the module docstring)."""

    def __init__(self, name: str, idle_s: float = 2.0, stall_s: float = STALL_S) -> None:
        self._name, self._idle_s, self._stall_s = name, idle_s, stall_s
        self._items: deque[tuple[Callable[[Any], Any], Any]] = deque()
        self._cond = threading.Condition()
        self._running = False  # a delivering thread of the current generation exists
        self._generation = 0  # bumped when a stalled thread is left to its callback
        self._current: tuple[Callable[[Any], Any], float] | None = None  # the callback running, since when
        self._watching = False

    def post(self, fn: Callable[[Any], Any], arg: Any) -> None:
        with self._cond:
            self._items.append((fn, arg))
            if self._running:  # it queues behind a callback that may be running: watch for a stall
                if not self._watching:
                    self._watching = True
                    threading.Thread(target=self._watch, name=f"{self._name}-watch", daemon=True).start()
                self._cond.notify_all()
                return
            self._running = True
        self._spawn(self._generation)

    def _spawn(self, generation: int) -> None:
        threading.Thread(target=self._loop, args=(generation,), name=self._name, daemon=True).start()

    def _loop(self, generation: int) -> None:
        while True:
            with self._cond:
                if self._generation != generation:
                    return  # this thread stalled in a callback; a fresh one delivers now
                if not self._items:
                    self._cond.wait(timeout=self._idle_s)
                if self._generation != generation:
                    return
                if not self._items:
                    self._running = False
                    return
                fn, arg = self._items.popleft()
                self._current = (fn, time.monotonic())
            try:
                fn(arg)
            except BaseException:  # a user's callback must not stop delivery to the others
                logger.exception("a done-callback raised (ignored, as concurrent.futures does)")
            with self._cond:
                if self._generation == generation:
                    self._current = None

    def _watch(self) -> None:
        """While callbacks wait behind a running one: past `stall_s`, move them to a fresh thread."""
        with self._cond:
            while self._items and self._running:
                if self._current is None:  # between callbacks: the next one starts soon
                    self._cond.wait(self._stall_s)
                    continue
                fn, since = self._current
                left = since + self._stall_s - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                logger.warning("done-callback %r has run for %.1f s; the %d callback(s) after it go on on a "
                               "fresh thread", fn, time.monotonic() - since, len(self._items))
                self._generation += 1
                self._current = None
                self._spawn(self._generation)
            self._watching = False


def awaitable(future: Future) -> asyncio.Future:
    """`future` awaited on the running loop. An EngineFuture hands its outcome to the loop from the thread
    that sets it (it only schedules the loop), never behind user done-callbacks; cancelling the
    asyncio future cancels `future` (as `asyncio.wrap_future` does)."""
    loop = asyncio.get_running_loop()
    out = loop.create_future()

    def copy(done: Future) -> None:  # on the loop
        if out.cancelled():
            return
        if done.cancelled():
            out.cancel()
        elif done.exception() is not None:
            out.set_exception(done.exception())
        else:
            out.set_result(done.result())

    def hand_off(done: Future) -> None:  # on the thread that finished `future`: never blocks
        try:
            loop.call_soon_threadsafe(copy, done)
        except RuntimeError:  # the loop is closed: nobody awaits any more
            pass
    out.add_done_callback(lambda o: future.cancel() if o.cancelled() else None)
    if isinstance(future, EngineFuture):
        future.add_loop_callback(hand_off)
    else:
        future.add_done_callback(hand_off)
    return out


class EngineFuture(Future):
    """A `concurrent.futures.Future` of one engine request; see the module docstring.

    `cancel()` is True only while the request waits in the engine queue; the queue then
    removes it, so nothing reaches a rank. `replica` is the replica it was queued on, and
    `weight_version` the weight version of that replica when the request was dispatched to its
    ranks (weights change only while nothing is dispatched, so it is the version that produced
    the result; None before dispatch and for replicas that never had a versioned update).
    `timing()` says how long it queued and ran, in how large a batch, and whether it met its deadline.
    """

    def __init__(self, delivery: CallbackThread, on_cancel: Callable[["EngineFuture"], None]) -> None:
        super().__init__()
        self._delivery, self._on_cancel = delivery, on_cancel
        self.work: Any = None
        self.replica: int | None = None
        self.weight_version: Any = None
        self.submitted = time.monotonic()
        self.started: float | None = None  # dispatched to the ranks (iteration protocol: first admitted)
        self.finished: float | None = None  # its outcome was set
        self.batch_size = 0  # samples of the step (sequences of the iteration) it started in
        self.deadline: float | None = None  # its own deadline (monotonic), if it was given one

    def timing(self) -> dict[str, Any]:
        """{queue_ms, infer_ms (dispatch to outcome: the model's share, with the ranks' transport),
        batch_size, deadline_ms (as given; None), deadline_met (outcome by the deadline; None without one)}."""
        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1e3, 3)
        end = self.finished
        return {"queue_ms": ms(self.submitted, self.started if self.started is not None else end),
                "infer_ms": ms(self.started, end), "batch_size": self.batch_size,
                "deadline_ms": ms(self.submitted, self.deadline),
                "deadline_met": None if self.deadline is None or end is None else
                (end <= self.deadline and self.started is not None)}

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        if self.done():  # at once, here
            super().add_done_callback(fn)
        else:
            super().add_done_callback(lambda f: self._delivery.post(fn, f))

    def add_loop_callback(self, fn: Callable[[Future], Any]) -> None:
        """`fn` on the thread that finishes this future: it must never block (`awaitable`'s hand-off)."""
        super().add_done_callback(fn)

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        _notify_cancelled(self)  # wakes wait() / as_completed() at once; nothing else will start it
        self._on_cancel(self)
        return True

    def start(self) -> bool:
        """Mark RUNNING for dispatch; False when it was cancelled (it must then not run)."""
        return _notify_cancelled(self)


def _notify_cancelled(future: Future) -> bool:
    try:
        return future.set_running_or_notify_cancel()
    except RuntimeError:  # already notified (cancel and dispatch raced) or finished
        return False


class HereResult:
    """The outcome of a request the caller's own thread runs (the inline fast path): it is set before
    that thread returns from the plugin, by it or by the replica's clock or failure (first wins), so
    nobody ever waits on it. A `concurrent.futures.Future` costs a Condition and a wake-up; this is
    what `Engine.step` pays per call instead, and no user ever holds it."""

    __slots__ = ("_lock", "_value", "_error", "_done", "work", "replica", "weight_version", "submitted",
                 "started", "finished", "batch_size", "deadline", "__weakref__")

    def __init__(self, replica: int, lock: Any) -> None:
        self._lock = lock  # the replica's (re-entrant): whoever sets the outcome holds it
        self._done, self._value, self._error = False, None, None
        self.work: Any = None
        self.replica, self.weight_version, self.deadline = replica, None, None
        self.submitted = self.started = time.monotonic()
        self.finished: float | None = None
        self.batch_size = 1

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._set(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._set(None, error)

    def _set(self, value: Any, error: BaseException | None) -> None:
        if not self.settle(value, error):
            raise RuntimeError("the outcome of this request was already set")  # ledger.settle: lost the race

    def settle(self, value: Any, error: BaseException | None) -> bool:
        """Set the outcome unless it is set (the clock or a failure may race the running thread); True when set."""
        with self._lock:
            if self._done:
                return False
            self.finished = time.monotonic()
            self._value, self._error, self._done = value, error, True
        return True

    def cancel(self) -> bool:
        return False  # it is running

    def start(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:  # never: the running thread sets it before it returns
            raise RuntimeError("the caller's own request has no outcome yet")
        if self._error is not None:
            raise self._error
        return self._value
