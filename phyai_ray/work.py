"""`Kind`: what one unit of work a replica sends to its ranks is, and the one place each kind runs;
`Work`: one such unit in a replica's pipeline (its payload, deadline, future, batch members).

    Kind.STEP     one request: `model.step(request)`
    Kind.BATCH    several requests as one step: `model.step_batch(requests)` (one result each)
    Kind.ITERATE  one iteration of the continuous-batching loop: an `IterationPlan`
    Kind.STREAM   one request whose partial outputs go to a sink: `model.stream(request, emit)`
    Kind.CALL     a collective_rpc: a public method of the per-rank model, (method, args, kwargs)

Every executor (inline, Ray replica, torchrun) queues work of these kinds, and every rank runs it
through `RankRunner.execute(kind, payload, sink)` (phyai_ray/rank/runner.py), so a kind means one thing
everywhere. A `str` enum: a kind travels (pickled, in a lane frame) as its plain name.
"""

from __future__ import annotations

import itertools
import threading
import time
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phyai_ray.executors.futures import EngineFuture


class Kind(str, Enum):
    STEP = "step"
    BATCH = "batch"
    ITERATE = "iterate"
    STREAM = "stream"
    CALL = "call"

    def __str__(self) -> str:
        return self.value


# the members as plain names for the per-request path: `Kind.STEP` is an attribute lookup through the
# enum's metaclass (about 160 ns on CPython 3.11), `STEP` a global read
STEP, BATCH, ITERATE, STREAM, CALL = Kind.STEP, Kind.BATCH, Kind.ITERATE, Kind.STREAM, Kind.CALL
REQUEST_KINDS = frozenset({Kind.STEP, Kind.STREAM})  # counted as requests; a CALL (collective_rpc) is not
_ids = itertools.count()


class Work:
    """One request ("step", "stream"), collective_rpc ("call"), batch of requests ("batch") or iteration
    of the continuous-batching loop ("iterate") of one replica.

    `here` marks a request the caller's own thread runs (the inline fast path): it was dispatched
    without `launch`, and the caller runs it right after `submit` returns. A request's `key`,
    `size` and `weight` feed batch formation; a batch's `members` are its requests, in order, and
    its `payload` is the list of their payloads. `deadline` is the request's own deadline (monotonic
    seconds; None: none given): past it, a request that has not started is answered with
    DeadlineMissedError. `due` is the queue-order deadline of a request without its own
    (`BatchingConfig.default_deadline_s` after arrival): it orders, it never fails it. `late` is what
    happens to a result ready after `deadline`: "finish" delivers it, "drop" answers the miss. `expires` is when its execution timeout (`limit_s` after submission)
    fails it. `order` is what earliest-deadline-first scheduling sorts by.
    """

    __slots__ = ("kind", "payload", "limit_s", "future", "all_ranks", "submitted", "dispatched",
                 "ident", "state", "here", "key", "size", "weight", "members", "launched", "deadline",
                 "due", "late")

    def __init__(self, kind: str, payload: Any, limit_s: float, future: EngineFuture | None,
                 all_ranks: bool = False) -> None:
        self.kind, self.payload, self.limit_s, self.future, self.all_ranks = kind, payload, limit_s, future, all_ranks
        self.submitted = time.monotonic()
        self.dispatched: float | None = None
        self.ident = next(_ids)
        self.state: Any = None  # the executor's per-dispatch record (e.g. which ranks replied)
        self.here = False
        self.key: Any = None
        self.size, self.weight = 1, 0
        self.members: list[Work] = []
        self.launched: threading.Event | None = None  # set by an executor once sent (a stream's reader waits on it)
        self.deadline: float | None = None
        self.due: float | None = None  # no own deadline: when it should be served by (default_deadline_s)
        self.late = "finish"  # "drop": a result ready after `deadline` is replaced by DeadlineMissedError

    @classmethod
    def batch(cls, members: list["Work"]) -> "Work":
        """One step of several requests; it expires with its earliest-expiring member."""
        first = min(members, key=lambda m: m.expires)
        work = cls(Kind.BATCH, [m.payload for m in members], first.limit_s, None)
        work.submitted, work.members = first.submitted, members
        work.size = sum(m.size for m in members)
        return work

    @property
    def expires(self) -> float:
        """When its execution timeout fails it: `limit_s` after submission."""
        return self.submitted + self.limit_s

    @property
    def order(self) -> float:
        """Earliest-deadline-first key: the request's own deadline, else its `due`, else when it expires."""
        if self.deadline is not None:
            return self.deadline
        return self.due if self.due is not None else self.submitted + self.limit_s

    def missed(self, now: float, service_s: float = 0.0) -> bool:
        """Its own deadline cannot be met by a start at `now` and a step of `service_s` (only
        meaningful before it starts)."""
        return self.deadline is not None and self.deadline <= now + service_s

    @property
    def unfinished(self) -> bool:
        """Some future of this work (its own, or a member's) has no outcome yet."""
        if self.kind == BATCH:
            return any(not m.future.done() for m in self.members)
        return not self.future.done()

    def requests(self) -> list["Work"]:
        """The requests this work carries: its members, itself, or none (a collective_rpc)."""
        if self.kind == BATCH:
            return self.members
        return [self] if self.kind in REQUEST_KINDS else []
