"""One watchdog thread per executor that fails requests whose deadline passed.

Deadlines are absolute `time.monotonic()` values; the thread starts on the first `add`, sleeps
until the earliest deadline, and calls `on_expire(future)` for each one still unfinished.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from concurrent.futures import Future
from typing import Callable


class DeadlineWatch:
    """Calls `on_expire(future)` once for every watched future still running at its deadline."""

    def __init__(self, on_expire: Callable[[Future], None], name: str) -> None:
        self._on_expire, self._name = on_expire, name
        self._heap: list[tuple[float, int, Future]] = []
        self._count = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, future: Future, deadline: float) -> None:
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (deadline, next(self._count), future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            expired = self._next_expired()
            if expired is None:
                return
            for future in expired:
                self._on_expire(future)

    def _next_expired(self) -> list[Future] | None:
        with self._cond:
            while not self._closed:
                while self._heap and self._heap[0][2].done():
                    heapq.heappop(self._heap)
                now = time.monotonic()
                if self._heap and self._heap[0][0] <= now:
                    return self._pop_until(now)
                self._cond.wait(timeout=(self._heap[0][0] - now) if self._heap else 1.0)
            return None

    def _pop_until(self, now: float) -> list[Future]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            future = heapq.heappop(self._heap)[2]
            if not future.done():
                out.append(future)
        return out
