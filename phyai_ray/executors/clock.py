"""`DeadlineClock`: one timer thread per replica that wakes the parts watching it when a deadline comes.

    clock = DeadlineClock(index, lock)       the replica's lock, shared with the parts it serves
    clock.watch(next_deadline, due)          a part registers: `next_deadline()` (lock held) is the
                                             earliest time it needs waking at, `due(now)` (lock free)
                                             does what is due: fail expired requests, flush a batch,
                                             report a hung call
    clock.arm(when)                          (lock held) make the thread wake by `when`; it starts on
                                             first need
    clock.stop()                             the thread ends (the replica failed or closed)

The thread sleeps until the earliest deadline any part reports (limits may differ, so the head of a
queue need not hold the earliest), and at least every `_CLOCK_TICK_S`, then calls each part's `due`
in the order they registered. The replica's request queue (`StepQueue`, queues.py) and its rank
pipeline (`RankPipeline`, pipeline.py) watch it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

_CLOCK_TICK_S = 5.0  # the clock thread re-reads every deadline at least this often


class DeadlineClock:
    """The replica's timer thread (see the module docstring)."""

    def __init__(self, index: int, lock: threading.RLock) -> None:
        self.index, self._lock = index, lock
        self._cond = threading.Condition(lock)
        self._watchers: list[tuple[Callable[[], float], Callable[[float], None]]] = []
        self._timer: threading.Thread | None = None
        self._stopped = False
        self._wake_at = float("inf")  # the earliest deadline the clock knows of
        self._wakes_by = float("inf")  # when the thread wakes anyway (it re-reads every deadline then)

    def watch(self, next_deadline: Callable[[], float], due: Callable[[float], None]) -> None:
        """Register a part: `next_deadline()` is read with the lock held, `due(now)` called without it."""
        self._watchers.append((next_deadline, due))

    def arm(self, when: float) -> None:
        """Make the timer thread wake by `when` (lock held). No wake-up when it wakes earlier anyway:
        a request's default deadline is minutes away, and waking the clock on every submit would
        put a third thread on the request path."""
        if when >= self._wake_at or when >= self._wakes_by:
            return
        self._wake_at = when
        if self._timer is None:
            self._timer = threading.Thread(target=self._run, name=f"phyai-replica-{self.index}-clock", daemon=True)
            self._timer.start()
        else:
            self._cond.notify_all()

    def stop(self) -> None:
        """End the thread at its next look (idempotent)."""
        with self._lock:
            self._stopped = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                self._wake_at = min((next_deadline() for next_deadline, _ in self._watchers), default=float("inf"))
                now = time.monotonic()
                delay = self._wake_at - now
                if delay > 0:
                    self._wakes_by = now + min(delay, _CLOCK_TICK_S)
                    self._cond.wait(timeout=min(delay, _CLOCK_TICK_S))
                    self._wakes_by = float("-inf")  # awake: it re-reads every deadline before it waits
                    # again, so until then an `arm` needs no notify (`when >= -inf`: it returns at once)
                    continue
            for _, due in self._watchers:
                due(time.monotonic())
