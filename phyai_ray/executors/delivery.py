"""Futures whose done-callbacks run on a thread of the engine's own.

A result is set by whatever thread learns it (a Ray reply thread, the plugin's thread); waiters
(`result()`, `wait()`) wake at once. User done-callbacks are handed to a `CallbackThread` instead of
running on the setting thread, so a callback may call the engine again (even `engine.step()`):
the reply it waits for is set by another thread, never by the one the callback occupies.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

logger = logging.getLogger(__name__)


class CallbackThread:
    """Runs posted callbacks in order on one daemon thread that exits when idle."""

    def __init__(self, name: str, idle_s: float = 2.0) -> None:
        self._name, self._idle_s = name, idle_s
        self._items: deque[tuple[Callable[[Any], Any], Any]] = deque()
        self._cond = threading.Condition()
        self._running = False

    def post(self, fn: Callable[[Any], Any], arg: Any) -> None:
        with self._cond:
            self._items.append((fn, arg))
            if self._running:
                self._cond.notify()
                return
            self._running = True
        threading.Thread(target=self._loop, name=self._name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._items:
                    self._cond.wait(timeout=self._idle_s)
                if not self._items:
                    self._running = False
                    return
                fn, arg = self._items.popleft()
            try:
                fn(arg)
            except Exception:  # a user's callback must not stop delivery to the others
                logger.exception("a done-callback raised (ignored, as concurrent.futures does)")


class EngineFuture(Future):
    """A `concurrent.futures.Future` of one engine request; see the module docstring.

    `cancel()` is True only while the request waits in the engine queue; the scheduler then
    removes it, so nothing reaches a rank. `replica` is the replica it was queued on, and
    `weight_version` the weight version of that replica when the request was dispatched to its
    ranks (weights change only while nothing is dispatched, so it is the version that produced
    the result; None before dispatch and for replicas that never had a versioned update).
    """

    def __init__(self, delivery: CallbackThread, on_cancel: Callable[["EngineFuture"], None]) -> None:
        super().__init__()
        self._delivery, self._on_cancel = delivery, on_cancel
        self.work: Any = None
        self.replica: int | None = None
        self.weight_version: Any = None

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        if self.done():  # as concurrent.futures does: a finished future calls back at once, here
            super().add_done_callback(fn)
        else:
            super().add_done_callback(lambda f: self._delivery.post(fn, f))

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
