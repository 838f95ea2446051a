"""A request's own time limit in the iteration loop, apart from the hang limit of one iteration.

    limits = RequestLimits(cap_s=proc.execution_timeout_s, hang_s=proc.hang_limit_s)
    limits.open(req, planned)            at submit: `req.expires` is the cap, or none
    for req, error in limits.due(requests, now, pace, index): ...   requests past their cap or estimate

Two clocks, for two different questions:

* The hang limit (`WorkerSupervisorConfig.rank_call_timeout_s`): how long ONE iteration (one rank
  call) may run before the replica is judged stuck. The rank pipeline's `DeadlineClock` applies it
  to every iteration; a rank that answers keeps the replica alive, however long the job.
* A request's own limit: its deadline (`Engine.submit(deadline_s=)`, ...) when it has one; else
  `execution_timeout_s` when that is set (an explicit cap from submission, queueing included, as
  before); else, once the request runs, its planned iterations (`SequenceSpec.steps`, the longest
  sequence's) x the loop's recent iteration time, twice over, plus the hang limit as a margin.
  A request whose steps are unknown has no such limit: its iterations' hang limit still holds.

Worked example: a 2,000-step video job of 0.5 s iterations with the defaults (hang limit 600 s, no
cap) may run 2 x 2,000 x 0.5 + 600 = 2,600 s; each of its iterations may take up to 600 s.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Collection

from phyai_ray.errors import RequestTimeoutError
from phyai_ray.executors.ledger import timed_out

_CHECK_EVERY_S = 0.5  # running requests are measured against their estimate at most this often


class RequestLimits:
    """The requests' own limits of one iteration loop (see the module docstring)."""

    def __init__(self, cap_s: float | None, hang_s: float) -> None:
        self.cap_s, self.hang_s = cap_s, hang_s
        self._planned: dict[Any, int] = {}  # request -> its planned iterations (uncapped, steps known)
        self._next_check = 0.0

    def open(self, req: Any, planned: int | None) -> None:
        """At submit: with a cap, `req.expires` stays submission + cap; without one it never expires by
        the clock while waiting (its deadline and the queue bound still apply) and gets an estimate."""
        if self.cap_s is not None:
            return
        req.expires = math.inf
        if planned is not None:
            self._planned[req] = planned

    def allowed_s(self, planned: int, pace_s: float) -> float:
        """Seconds a running request of `planned` iterations may run at a pace of `pace_s` each."""
        return 2.0 * planned * pace_s + self.hang_s

    def over(self, requests: Collection[Any], now: float, pace_s: float) -> list[Any]:
        """Running requests past their estimate (checked at most every half second)."""
        if not self._planned or now < self._next_check:
            return []
        self._next_check = now + _CHECK_EVERY_S
        late = []
        for req, planned in list(self._planned.items()):
            started = getattr(req.future, "started", None)
            if req not in requests:  # it left the loop (ended, failed, cancelled)
                del self._planned[req]
            elif req.admitted and started and now - started > self.allowed_s(planned, pace_s):
                late.append(req)
        return late

    def due(self, requests: Collection[Any], now: float, pace_s: float, index: int) -> list[tuple[Any, BaseException]]:
        """(request, its RequestTimeoutError) of each request past its limit: its cap (`requests` in
        submission order, so in the order they expire) or, running, its estimate."""
        late = [(req, self.error(index, req, now, pace_s)) for req in self.over(requests, now, pace_s)]
        if self.cap_s is None:
            return late
        expired = itertools.takewhile(lambda r: r.expires <= now, requests)
        return late + [(req, timed_out(index, now - req.submitted, self.cap_s, "its sequences were dropped at the "
                                       "next iteration" if req.admitted else "it never got a sequence slot",
                                       dispatched=req.admitted)) for req in expired]

    def error(self, index: int, req: Any, now: float, pace_s: float) -> RequestTimeoutError:
        planned = self._planned.get(req, 0)
        return RequestTimeoutError(
            f"replica {index}: the request ran {now - req.future.started:.1f}s, past its own limit of "
            f"{self.allowed_s(planned, pace_s):.1f}s (2 x {planned} planned iteration(s) x {pace_s * 1e3:.1f} ms + "
            f"rank_call_timeout_s={self.hang_s}); its sequences were dropped at the next iteration. Give it a "
            "deadline or set execution_timeout_s to choose its limit", replica=index, waited_s=now - req.submitted,
            dispatched=True)

