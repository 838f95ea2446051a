"""The scheduler's clock: one timer thread per replica that fails expired requests and notices a hung head.

    _arm(when)     make the thread wake by `when` (lock held); it starts on first need
    _clock()       the thread: sleep until the earliest deadline (or a tick), flush a waiting batch,
                   then `expire(now)`
    expire(now)    fail queued and dispatched requests past their time (DeadlineMissedError when their
                   own deadline passed before they started, else RequestTimeoutError), or report the
                   head of the dispatched line hung (running past its limit) to `on_hung`, once

The thread wakes only for the earliest deadline of any queued or dispatched request (limits may
differ, so the queue's head need not hold the earliest), and at least every `_CLOCK_TICK_S`.
A part of `ReplicaScheduler` (scheduler.py), whose lock, queues and callbacks it uses.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from phyai_ray.errors import RequestTimeoutError
from phyai_ray.executors.ledger import deadline_missed, timed_out
from phyai_ray.work import BATCH, CALL, Work

_CLOCK_TICK_S = 5.0  # the clock thread re-reads every deadline at least this often


class DeadlineClock:
    """The clock half of `ReplicaScheduler` (see the module docstring)."""

    def _arm(self, when: float) -> None:
        """Make the timer thread wake by `when` (lock held). No wake-up when it wakes earlier anyway:
        a request's default deadline is minutes away, and waking the clock on every submit would
        put a third thread on the request path."""
        if when >= self._wake_at or when >= self._wakes_by:
            return
        self._wake_at = when
        if self._timer is None:
            self._timer = threading.Thread(target=self._clock, name=f"phyai-replica-{self.index}-clock", daemon=True)
            self._timer.start()
        else:
            self._cond.notify_all()

    def _clock(self) -> None:
        while True:
            with self._lock:
                if self._refusal is not None:
                    return
                self._wake_at = self._next_deadline()
                now = time.monotonic()
                delay = self._wake_at - now
                if delay > 0:
                    self._wakes_by = now + min(delay, _CLOCK_TICK_S)
                    self._cond.wait(timeout=min(delay, _CLOCK_TICK_S))
                    self._wakes_by = float("-inf")  # awake: it re-reads every deadline before it waits
                    # again, so until then an _arm needs no notify (`when >= -inf`: it returns at once)
                    continue
                if self._flush_at <= time.monotonic():  # a waiting batch head's delay is over
                    self._flush_at = float("inf")
                    self._pump()
            self._send_launches()
            self.expire(time.monotonic())

    def expire(self, now: float) -> None:
        """Fail the requests whose deadline is past `now`, or report the hung head (the clock's job)."""
        with self._lock:
            if self._refusal is not None:
                return
            expired, hung = self._expired(now)
            running_s = now - self._head_since
        for work in expired:
            self.deliver(work, error=self._missed_error(work, now) if work.dispatched is None and work.missed(now)
                         else self._timeout_error(work, now))
        if hung is not None:
            with self._lock:
                self._reported_hung = hung
            self._on_hung(hung, running_s)

    def _expired(self, now: float) -> tuple[list[Work], Work | None]:
        """Requests past their deadline (queued ones leave the queue), and the hung head if any."""
        head = self._dispatched[0] if self._dispatched else None
        if head is not None and head is not self._reported_hung and now - self._head_since >= head.limit_s:
            return [], head
        expired = [w for w in self._queued if w.expires <= now or w.missed(now)]
        if expired:
            self._queued = deque(w for w in self._queued if w.expires > now and not w.missed(now))
        expired += [r for w in self._dispatched for r in (w.requests() if w.kind == BATCH else [w])
                    if r.expires <= now and not r.future.done()]
        return expired, None

    def _next_deadline(self) -> float:
        times = [r.expires for w in self._dispatched for r in (w.requests() if w.kind == BATCH else [w])
                 if not r.future.done()]
        times.append(self._flush_at)
        times += [w.expires if w.deadline is None else min(w.expires, w.deadline) for w in self._queued]
        if self._dispatched and self._dispatched[0] is not self._reported_hung:
            times.append(self._head_since + self._dispatched[0].limit_s)
        return min(times, default=float("inf"))

    def _missed_error(self, work: Work, now: float) -> RequestTimeoutError:
        """A request that was not run: its deadline passed, or comes before the recent step time."""
        service_s = self.service.estimate() if work.deadline > now else 0.0
        return deadline_missed(self.index, now - work.submitted, work.deadline - work.submitted, service_s)

    def _timeout_error(self, work: Work, now: float) -> RequestTimeoutError:
        where = ("it was still queued and never reached a rank" if work.dispatched is None else
                 "it had been dispatched to the ranks, which finish it but its result is dropped")
        what = "collective_rpc timeout" if work.kind == CALL else "execution_timeout_s"
        return timed_out(self.index, now - work.submitted, work.limit_s, where, dispatched=work.dispatched is not None,
                         what=what)
