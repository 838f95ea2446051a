"""`BoundedLane`: what a replica's request lanes (sockets, compiled graph) share on the sending side.

A lane holds at most `capacity` messages at the ranks; a message sent beyond that waits in the
backlog, in order, until a reply frees a slot, so `send` never blocks the caller (it runs under the
replica scheduler's lock). Subclasses write a message with `_write` (lock held; it returns the
error of a message that did not serialize, so that request fails alone) and report `in_flight`.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

from actors.protocol import LaneRequest


class BoundedLane:
    def __init__(self, capacity: int, on_unsent: Callable[[Any, BaseException], None]) -> None:
        self.capacity = capacity
        self._on_unsent = on_unsent
        self._lock = threading.Lock()  # the writer end: send, backlog, and what the subclass guards with it
        self._backlog: deque[tuple[Any, LaneRequest]] = deque()  # beyond capacity, not yet written
        self._closed = False

    @property
    def in_flight(self) -> int:
        raise NotImplementedError

    def _write(self, tag: Any, request: LaneRequest) -> BaseException | None:
        raise NotImplementedError

    def send(self, tag: Any, request: LaneRequest) -> None:
        """Write `request` (or keep it, in order, until there is room); never blocks."""
        with self._lock:
            if self._backlog or self.in_flight >= self.capacity:
                self._backlog.append((tag, request))
                return
            error = self._write(tag, request)
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
