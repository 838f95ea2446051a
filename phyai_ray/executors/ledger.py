"""What both request queues of a replica share: outcomes, exact tallies, and the errors of a full
queue and of a passed deadline.

    StepQueue + RankPipeline (queues.py, pipeline.py)   requests as steps or batches of steps
    IterationLoop            (iterations.py)            requests as sequences of the continuous-batching loop

    Counts                               queued / dispatched / served / errored of one replica
    tally.settle(future, value, error)   resolve once; a request counts as served or errored once
    overloaded(index, queued, limit, behind)          EngineOverloadedError naming the bounds
    timed_out(index, waited_s, limit, where, ...)     RequestTimeoutError saying where it was
    deadline_missed(index, waited_s, given_s)         DeadlineMissedError: its own deadline passed first
    missed_error(index, work, now, service_s)         the same, for a `Work` that was not run
    timeout_error(index, work, now)                   RequestTimeoutError of a `Work`, queued or dispatched
    enqueue(queue, item, edf)                         arrival order, or earliest deadline first
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from phyai_ray.errors import DeadlineMissedError, EngineOverloadedError, RequestTimeoutError
from phyai_ray.work import CALL


@dataclass(frozen=True)
class Counts:
    """Exact accounting of one replica's requests (collective_rpc calls and iterations are not counted).

    `dispatched` counts requests at the ranks whose future is unfinished, so a result in hand is
    never still in flight; `in_flight` (queued + dispatched) is what routing compares.
    """

    queued: int
    dispatched: int
    served: int
    errored: int

    @property
    def in_flight(self) -> int:
        return self.queued + self.dispatched


def settle(future: Future, value: Any, error: BaseException | None) -> bool:
    """Finish `future` unless it already is (stamping when, for its timing); True when this call finished it."""
    if future.done():
        return False
    future.finished = time.monotonic()  # before the outcome: a waiter that wakes reads it
    try:
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)
    except Exception:  # InvalidStateError: finished concurrently
        return False
    return True


class Tally:
    """Served / errored totals of one replica's requests, each request counted once (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.served = self.errored = 0
        self.missed = 0  # of the errored: answered DeadlineMissedError (never ran)

    def settle(self, future: Future, value: Any, error: BaseException | None, *, counted: bool = True) -> bool:
        """`settle(future, ...)`; when it finished the future and `counted`, one more served or errored."""
        if not settle(future, value, error):
            return False
        if counted:
            self.count(error)
        return True

    def count(self, error: BaseException | None) -> None:
        """One more request served (`error` None) or errored."""
        with self._lock:
            if error is None:
                self.served += 1
            else:
                self.errored += 1
                self.missed += isinstance(error, DeadlineMissedError)

    def carry(self, totals: Counts) -> None:
        """Continue the served / errored totals of a replica this one replaces."""
        with self._lock:
            self.served += totals.served
            self.errored += totals.errored


def overloaded(index: int, queued: int, limit: int | None, behind: str) -> EngineOverloadedError:
    """The refusal of a full queue: `queued` waiting (max_queued_requests=`limit`) behind `behind`."""
    return EngineOverloadedError(f"replica {index} is full: {queued} request(s) wait (max_queued_requests={limit}) "
                                 f"behind {behind}", queued=queued, limit=limit)


def timed_out(index: int, waited_s: float, limit_s: float, where: str, *, dispatched: bool,
              what: str = "execution_timeout_s") -> RequestTimeoutError:
    """A request with no result `limit_s` after submission; `where` says what became of it."""
    return RequestTimeoutError(
        f"replica {index}: no result {waited_s:.2f}s after submission ({what}={limit_s}); {where}. "
        "The replica keeps serving; add replicas or lower the load if this repeats",
        replica=index, waited_s=waited_s, dispatched=dispatched)


def deadline_missed(index: int, waited_s: float, given_s: float | None, service_s: float = 0.0,
                    late_result: bool = False) -> DeadlineMissedError:
    """The answer to a request whose own deadline passed before it started, or that could not finish
    by it (`service_s`: the replica's recent step time), or whose result came after it and was
    dropped (`late_result`: late="drop")."""
    given = f"{given_s * 1e3:.1f} ms" if given_s is not None else "its deadline"
    if late_result:
        what = (f"passed after {waited_s * 1e3:.1f} ms, before its result was ready; the late result was dropped "
                "(late='drop'). Give it a later deadline, pass late='finish' to take late results, or add replicas")
    elif service_s > 0:
        what = (f"could not be met: {waited_s * 1e3:.1f} ms waited and a step takes about {service_s * 1e3:.1f} ms "
                "here lately; it was not run. Give it a later deadline, or add replicas or lower the load")
    else:
        what = (f"passed after {waited_s * 1e3:.1f} ms of waiting, before it started; it was not run. "
                "Give it a later deadline, or add replicas or lower the load")
    return DeadlineMissedError(f"replica {index}: the request's deadline ({given}) {what}",
                               replica=index, waited_s=waited_s, deadline_s=given_s)


def missed_error(index: int, work: Any, now: float, service_s: float) -> DeadlineMissedError:
    """A request that was not run: its deadline passed, or comes before the recent step time `service_s`."""
    return deadline_missed(index, now - work.submitted, work.deadline - work.submitted,
                           service_s if work.deadline > now else 0.0)


def timeout_error(index: int, work: Any, now: float) -> RequestTimeoutError:
    """A request (or collective_rpc) past its limit, queued or dispatched."""
    where = ("it was still queued and never reached a rank" if work.dispatched is None else
             "it had been dispatched to the ranks, which finish it but its result is dropped")
    what = "collective_rpc timeout" if work.kind == CALL else "execution_timeout_s"
    return timed_out(index, now - work.submitted, work.limit_s, where, dispatched=work.dispatched is not None,
                     what=what)


def enqueue(queue: deque, item: Any, edf: bool) -> None:
    """Append `item`, or with `edf` insert it after every item of no later `order` (earliest deadline
    first, arrival order among equals). Deadlines mostly arrive in order, so the scan is short."""
    if not edf or not queue or queue[-1].order <= item.order:
        queue.append(item)
        return
    i = len(queue) - 1
    while i > 0 and queue[i - 1].order > item.order:
        i -= 1
    queue.insert(i, item)
