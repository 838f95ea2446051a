"""The inline fast path of `ReplicaScheduler`: `Engine.step` on an idle inline replica, with no future.

    run_here(payload, limit_s, run)   when nothing is queued, dispatched or held and batching is off:
                                      dispatch a plain step, run it on this thread, settle and free it

A part of `ReplicaScheduler` (scheduler.py), whose lock, line and accounting it uses, as `DeadlineClock`
(clock.py) is. It exists because the general path (a `Work` queued, a `concurrent.futures.Future`
settled by another thread) cost 34 us per no-op step on a 2-core VM, and this one 6-7 us.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from phyai_ray.executors.futures import HereResult
from phyai_ray.work import STEP, Work


class HereRun:
    """The fast-path half of `ReplicaScheduler` (see the module docstring)."""

    def run_here(self, payload: Any, limit_s: float, run: Callable[[Any], Any]) -> HereResult | None:
        """The inline fast path: when nothing is queued, dispatched or held and batching is off, run a
        plain step on this thread now (`run(payload)`) and return its outcome; None otherwise (then
        `submit` as usual). It counts as dispatched meanwhile, so the hang clock and the accounting see
        it and other callers queue behind it. Its outcome is a `HereResult`, not a future: the clock or
        a failure may set it first (the caller then gets theirs), but nobody ever waits on it."""
        with self._lock:
            if self._refusal is not None or self._held or self._queued or self._dispatched or self.policy is not None:
                return None
            work = Work(STEP, payload, limit_s, None)
            work.future = outcome = HereResult(self.index, self._lock)
            work.here = True
            now = work.dispatched = self._head_since = outcome.started = time.monotonic()  # `_dispatch`, unrolled
            outcome.weight_version = self.weight_version
            self.stats.record_here(now - work.submitted)
            self._dispatched.append(work)
            self._arm(now + limit_s)
        try:
            value, error = run(payload), None
        except BaseException as exc:  # the plugin's own exception goes to the caller as is
            value, error = None, exc
        with self._lock:  # every setter of the outcome holds this lock: it is unset unless one came first
            if not outcome._done:
                outcome.finished, outcome._value, outcome._error, outcome._done = time.monotonic(), value, error, True
                self.tally.count(error)
            line = self._dispatched
            if len(line) == 1 and line[0] is work and not self._queued and not self._draining:
                line.pop()  # `_finish_locked` of the one thing at the rank, with nothing waiting behind it
                self._last_finish = now = time.monotonic()
                self.service.record(now - work.dispatched)
            else:
                self._finish_locked(work)
        if self._to_launch:
            self._send_launches()
        work.future = None  # no work <-> outcome cycle for the cyclic collector
        return outcome
