"""`ServiceTime`: how long one replica's steps take lately, the estimate finish-by admission uses.

    record(seconds)   one finished step (or iteration) ran this long at the ranks
    estimate()        the median of the last `window` of them; 0.0 before the first

A request with its own deadline starts only if `now + estimate()` is before that deadline
(scheduler.py, iterations.py): work that cannot finish in time is answered DeadlineMissedError at
once instead of taking a slot that a request able to finish needs. The median of a short recent
window follows a change of load (batch sizes, a weight update) within a few steps, and one slow
outlier (a garbage collection, a first compile) does not move it. Pure: no threads, no clock.
"""

from __future__ import annotations

from collections import deque
from statistics import median


class ServiceTime:
    """The recent median of step durations (seconds) of one replica."""

    def __init__(self, window: int = 16) -> None:
        if window < 1:
            raise ValueError(f"ServiceTime window={window} must be >= 1 (e.g. 16 recent steps)")
        self._recent: deque[float] = deque(maxlen=window)
        self._estimate = 0.0

    def record(self, seconds: float) -> None:
        """One step took `seconds` (ignored when negative: a clock step, not a duration)."""
        if seconds >= 0:
            self._recent.append(seconds)
            self._estimate = median(self._recent)

    def estimate(self) -> float:
        """Seconds the next step is expected to take: the recent median, 0.0 before any step."""
        return self._estimate
