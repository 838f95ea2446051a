"""`RequestDispatcher`: sends each whole request to ONE healthy replica.

Choice: among healthy replicas whose queue has room, a SERVING one before a paused, sleeping or
updating one (whose queue holds requests until it serves again), then the fewest in-flight
requests (queued in the engine + dispatched to its ranks); ties go to the replica chosen least
recently, so idle replicas take turns. A replica that refuses a request before queueing it (it just failed, or
its queue filled up meanwhile) is skipped and the next one is tried; a queued request is never
moved or retried. When every healthy replica is full, `submit` raises `EngineOverloadedError` at
once: overload sheds the new request and touches nothing else. When none is healthy it raises
`EngineUnavailableError`. A replica is anything that satisfies `Replica` (executors/replica.py).

The load routing compares is the dispatcher's own count of the requests it routed to each replica that
are not finished: the pick and the count are one step under one lock, so concurrent submits never choose
on the same count (a refusal or an exception gives the count back; a routed request's future gives it
back when it finishes, however it finishes). That lock is a leaf: the replicas' states (healthy, serving,
room) are read before it is taken, so a future finishing under a replica's lock never waits on a submit
that waits on that replica. `counts(i)` stays the replica's own (`Replica.counts()`), exact on every exit path.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Sequence

from phyai_ray.errors import EngineOverloadedError, EngineUnavailableError
from phyai_ray.executors.replica import Replica
from phyai_ray.executors.ledger import Counts


class RequestDispatcher:
    """Least-in-flight routing over replicas."""

    def __init__(self, replicas: Sequence[Replica], affinity_slack: int = 4) -> None:
        if not replicas:
            raise ValueError("a dispatcher needs at least one replica")
        self.replicas, self.affinity_slack = list(replicas), affinity_slack
        n = len(self.replicas)
        self._lock = threading.Lock()
        self._routed = [0] * n  # routed here and not finished: what the pick compares, under the lock
        self._last_chosen, self._tick = [-1] * n, 0
        self._sessions: OrderedDict[Any, int] = OrderedDict()
        self.max_sessions = 65536

    def submit(self, request: Any, session: Any = None, *, caller_runs: bool = False, key: Any = None,
               size: int = 1, deadline: float | None = None, late: str = "finish", affinity: Any = None) -> Future:
        """Route `request`; raises EngineOverloadedError / EngineUnavailableError at once.

        With a `session` key, the request goes to the replica the session last used while that
        replica is SERVING with room (multi-turn caches stay warm); else it is routed as usual and
        the session follows it. The map is a bounded LRU of `max_sessions` keys. `caller_runs` is
        passed on to the chosen replica (see `ScheduledReplica.submit`), and so are the batch `key`
        and `size` of the request, its own `deadline` (monotonic seconds) and `late`. With an `affinity`
        key instead of a session (routing="affinity": the samples of one prompt), the request goes
        where the key last went while that replica holds at most `affinity_slack` more routed,
        unfinished requests than the least loaded one; else it is routed as usual and the key follows.
        """
        if len(self.replicas) == 1 and session is None:
            return self._submit_single(request, caller_runs, key, size, deadline, late)
        send = lambda e: e.submit(request, caller_runs=caller_runs, key=key, size=size,  # noqa: E731
                                  deadline=deadline, late=late)
        if session is None and affinity is not None:
            return self.route(send, ("affinity", affinity), self.affinity_slack)
        return self.route(send, session)

    def route(self, send: Any, session: Any = None, slack: int | None = None) -> Any:
        """`send(replica)` on the replica `submit` would choose (retrying refusals); its return value: the
        request's future (or caller-run result), or a tuple whose first item is it. `slack`: the session's
        replica is kept only while it holds at most this many more routed requests than the least loaded."""
        refused: set[int] = set()
        overloaded: list[EngineOverloadedError] = []
        while True:
            index = self._sticky(session, refused, slack)
            if index is None:
                index = self._choose(refused, overloaded)
            if session is not None:
                self._remember(session, index)
            try:
                out = send(self.replicas[index])
            except EngineOverloadedError as exc:
                self._release(index)
                overloaded.append(exc)
                refused.add(index)
                continue
            except EngineUnavailableError:
                self._release(index)
                refused.add(index)
                continue
            except BaseException:
                self._release(index)
                raise
            self._release_when_done(out[0] if isinstance(out, tuple) else out, index)
            return out

    def _release_when_done(self, future: Any, index: int) -> None:
        """Give the count back when `future` finishes, on the thread that finishes it (an EngineFuture's
        loop callback: user callbacks run later, on the delivery thread; a caller-run result is done)."""
        if future.done():
            self._release(index)
            return
        hook = getattr(future, "add_loop_callback", None) or future.add_done_callback
        hook(lambda _f: self._release(index))

    def _release(self, index: int) -> None:
        with self._lock:
            self._routed[index] -= 1

    def _sticky(self, session: Any, refused: set[int], slack: int | None = None) -> int | None:
        if session is None:
            return None
        with self._lock:
            index = self._sessions.get(session)
        if index is None or index in refused:
            return None
        e = self.replicas[index]
        if not (e.healthy and e.serving and e.has_room()):
            return None
        others = [i for i, r in enumerate(self.replicas) if i not in refused and r.healthy and r.serving]
        with self._lock:
            if slack is not None and self._routed[index] > min(self._routed[i] for i in others) + slack:
                return None  # the key's replica is loaded past the slack: route as usual, the key follows
            if session in self._sessions:
                self._sessions.move_to_end(session)
            self._routed[index] += 1
            return index

    def _remember(self, session: Any, index: int) -> None:
        with self._lock:
            self._sessions[session] = index
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)

    def _submit_single(self, request: Any, caller_runs: bool, key: Any, size: int, deadline: float | None,
                       late: str = "finish") -> Future:
        """One replica: nothing to choose, the same errors as the general path (no lock, no lists)."""
        replica = self.replicas[0]
        try:
            return replica.submit(request, caller_runs=caller_runs, key=key, size=size, deadline=deadline, late=late)
        except EngineOverloadedError:
            raise self._overloaded_error(1) from None
        except EngineUnavailableError:
            raise self._no_replica_error() from None

    def _choose(self, refused: set[int], overloaded: list[EngineOverloadedError]) -> int:
        healthy = [i for i, e in enumerate(self.replicas) if i not in refused and e.healthy]
        open_ = [(i, not self.replicas[i].serving) for i in healthy if self.replicas[i].has_room()]
        if not open_:
            if healthy or overloaded:
                raise self._overloaded_error(len(healthy) + len(overloaded))
            raise self._no_replica_error()
        with self._lock:  # the pick and its count in one step
            index = min(open_, key=lambda c: (c[1], self._routed[c[0]], self._last_chosen[c[0]]))[0]
            self._routed[index] += 1
            self._last_chosen[index], self._tick = self._tick, self._tick + 1
            return index

    def load(self, index: int) -> int:
        """The requests routed to replica `index` and not finished: what the pick compares."""
        return self._routed[index]

    def replace(self, index: int, replica: Replica) -> None:
        """Route to `replica` from now on in place of replica `index` (its served/errored carry on)."""
        with self._lock:
            replica.carry_counts(self.replicas[index])
            self.replicas[index] = replica

    def counts(self, index: int) -> Counts:
        """Queued, dispatched, served and errored of one replica."""
        return self.replicas[index].counts()

    def _overloaded_error(self, full: int) -> EngineOverloadedError:
        limits = sorted({e.max_queued for e in self.replicas if e.healthy} - {None})
        queued = sum(e.counts().queued for e in self.replicas if e.healthy)
        return EngineOverloadedError(
            f"overloaded: all {full} healthy replica(s) have full queues ({queued} request(s) queued, "
            f"max_queued_requests={limits[0] if len(limits) == 1 else limits} per replica); the request was not "
            "admitted and nothing else was affected. Retry later, add replicas, or raise "
            "WorkerSupervisorConfig.max_queued_requests", queued=queued, limit=limits[0] if limits else None)

    def _no_replica_error(self) -> EngineUnavailableError:
        causes = "; ".join(f"replica {e.index}: {e.failure}" for e in self.replicas if e.failure is not None)
        return EngineUnavailableError(
            f"no healthy replica among {len(self.replicas)}: {causes or 'all refused the request'}",
            reason="no_healthy_replica")


def affinity_of(entry: Any, request: Any) -> Any:
    """The request's affinity key (`Entry.affinity_key`; None for an entry without one)."""
    key = getattr(entry, "affinity_key", None)
    return key(request) if callable(key) else None
