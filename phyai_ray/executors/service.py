"""`ServiceTime`: how long one replica's steps take lately, the estimate finish-by admission uses.

    record(seconds)   one finished step ran this long at the ranks (the iteration loop records its
                      pace instead: back to back, an iteration's run plus its own work until the next)
    estimate()        the median of the last `window` of them; 0.0 before the first

`record` runs after every step, `estimate` only when a request with a deadline arrives or a batch
forms, so the median is taken when asked (and kept until the next record), never per step.

A request with its own deadline starts only if `now + estimate()` is before that deadline
(queues.py, iterations.py): work that cannot finish in time is answered DeadlineMissedError at
once instead of taking a slot that a request able to finish needs. The median of a short recent
window follows a change of load (batch sizes, a weight update) within a few steps, and one slow
outlier (a garbage collection, a first compile) does not move it. Pure: no threads, no clock.
"""

from __future__ import annotations

from collections import deque


class ServiceTime:
    """The recent median of step durations (seconds) of one replica."""

    def __init__(self, window: int = 16) -> None:
        if window < 1:
            raise ValueError(f"ServiceTime window={window} must be >= 1 (e.g. 16 recent steps)")
        self._recent: deque[float] = deque(maxlen=window)
        self._records = 0  # steps recorded so far: tells whether the kept median is current
        self._kept = (0, 0.0)  # (records it was taken after, the median then)

    def record(self, seconds: float) -> None:
        """One step took `seconds` (ignored when negative: a clock step, not a duration)."""
        if seconds >= 0:
            self._recent.append(seconds)
            self._records += 1

    def estimate(self) -> float:
        """Seconds the next step is expected to take: the recent median, 0.0 before any step.

        Safe beside a concurrent `record`: the median is of one snapshot of the window, and it is
        kept under the record count read before the snapshot, so a step recorded meanwhile makes
        the next call take it again."""
        records, value = self._kept
        if records == self._records:
            return value
        records = self._records
        ordered = sorted(self._recent)  # one C-level copy of the window
        half = len(ordered) // 2
        value = ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2
        self._kept = (records, value)
        return value
