"""Batch formation: which queued requests of one replica run together as one step. Pure: no Ray, no threads.

    queue (arrival order):  a1 a2 b1 a3 b2 a4      (letters: batch keys; max_size=3)
    form_batch ->           [a1 a2 a3]             the head leads; same-key requests join in order
    queue after:            b1 b2 a4               b1 now leads the next batch (a head is never starved)

Rules (Triton's dynamic batcher, with Ray Serve's `@serve.batch` as the simple case):
* The head of the queue always leads the batch; requests with another key stay in place.
* A request joins while the batch's samples (`size`) stay within `max_size`; one that does not fit
  is passed over, not dropped, and a request larger than `max_size` runs alone.
* Expired or cancelled requests (`live(item)` is False) never join: they leave the queue as `dead`.
* Dispatch at once when the batch is full, when it ends exactly at a preferred size (cut there),
  or when `max_delay_s` is 0. Otherwise the head waits until `flush_at(head)`: at most
  `max_delay_s` after it arrived, and never more than half its time limit; and for each member
  with its own deadline, never past that deadline minus `service_s` (the replica's recent step
  time) minus a margin (`flush_margin`: a quarter of a step, at least 2 ms, for the timer's
  wake-up and the finish-by check at dispatch), nor past half its way to it, so an idle replica
  never holds a request until it is too late to meet a deadline it could have met.
* `max_weight` bounds a per-message resource summed over the batch (e.g. the shared-memory file
  descriptors one socket message can carry).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

MIN_FLUSH_MARGIN_S = 0.002  # a held request is dispatched at least this long before its step must start


def flush_margin(service_s: float) -> float:
    """How long before the last moment a step of `service_s` could start a held request is dispatched:
    a quarter of a step, at least 2 ms (the timer wakes late; finish-by admission at dispatch
    refuses a start that leaves exactly one step, and a step varies around its median)."""
    return max(MIN_FLUSH_MARGIN_S, 0.25 * service_s)


class Queued(Protocol):
    key: Any
    size: int
    weight: int
    submitted: float
    limit_s: float
    deadline: float | None


@dataclass(frozen=True)
class BatchPolicy:
    max_size: int
    max_delay_s: float = 0.0
    preferred: tuple[int, ...] = ()
    max_weight: int | None = None
    scan_limit: int = 4096  # queued requests looked at per batch (bounds the cost of a deep queue)

    @property
    def idle_gap_s(self) -> float:
        """How long a replica must have been idle before a lone request runs on the caller's thread."""
        return max(0.002, self.max_delay_s)

    def flush_at(self, head: Queued, members: list | tuple = (), service_s: float = 0.0) -> float:
        """When a head waiting for a fuller batch is dispatched anyway: `max_delay_s` after it arrived
        (at most half its time limit), and early enough that every own deadline among the head and
        `members` can still be met: before it less a step of `service_s` and `flush_margin`, and within
        half of it."""
        due = head.submitted + min(self.max_delay_s, head.limit_s / 2)
        latest_start = service_s + flush_margin(service_s)
        for item in (head, *members):
            if item.deadline is not None:
                half = item.submitted + (item.deadline - item.submitted) / 2
                due = min(due, item.deadline - latest_start, half)
        return due


@dataclass
class Formed:
    batch: list = field(default_factory=list)  # dispatch these now, in arrival order
    dead: list = field(default_factory=list)  # expired or cancelled: removed from the queue
    wait_until: float | None = None  # nothing to dispatch yet: the head waits for more until then


def form_batch(queue: deque, policy: BatchPolicy, now: float, live: Callable[[Any], bool],
               service_s: float = 0.0) -> Formed:
    """Take the next batch out of `queue` (changed in place), or say how long its head may wait.
    `service_s`: how long a step takes lately (it caps the wait by the members' deadlines)."""
    formed = Formed()
    while queue and not live(queue[0]):
        formed.dead.append(queue.popleft())
    if not queue:
        return formed
    chosen, cut, scanned = _scan(queue, policy, live, formed.dead)
    total = sum(item.size for item in chosen)
    if total >= policy.max_size:
        batch = chosen
    elif cut:
        batch = chosen[:cut]
    elif policy.max_delay_s <= 0 or now >= policy.flush_at(queue[0], chosen, service_s):
        batch = chosen
    else:
        batch, formed.wait_until = [], policy.flush_at(queue[0], chosen, service_s)
    _remove(queue, scanned, {id(item) for item in batch} | {id(item) for item in formed.dead})
    formed.batch = batch
    return formed


def _kind(item: Any) -> Any:
    """A queued item's work kind (a stream never joins a batch of steps); None for a plain item."""
    return getattr(item, "kind", None)


def _scan(queue: deque, policy: BatchPolicy, live: Callable[[Any], bool],
          dead: list) -> tuple[list, int, int]:
    """(requests that would share the head's batch, the longest prefix ending at a preferred size, items scanned)."""
    head = queue[0]
    chosen, total, weight, cut, scanned = [head], head.size, head.weight, 0, 0
    if total in policy.preferred:
        cut = 1
    for scanned, item in enumerate(queue, start=1):
        if scanned == 1:
            continue
        if total >= policy.max_size or scanned > policy.scan_limit:
            break
        if not live(item):
            dead.append(item)
            continue
        if item.key != head.key or total + item.size > policy.max_size or _kind(item) != _kind(head):
            continue
        if policy.max_weight is not None and weight + item.weight > policy.max_weight:
            continue
        chosen.append(item)
        total, weight = total + item.size, weight + item.weight
        if total in policy.preferred:
            cut = len(chosen)
    return chosen, cut, scanned


def _remove(queue: deque, scanned: int, gone: set[int]) -> None:
    """Drop the items whose id is in `gone` from the first `scanned` items of `queue`, keeping order."""
    if not gone:
        return
    kept = [item for _, item in zip(range(scanned), queue) if id(item) not in gone]
    for _ in range(scanned):
        queue.popleft()
    queue.extendleft(reversed(kept))


class Histogram:
    """Cumulative bucket counts and a sum, Prometheus style (`le` upper bounds, +Inf last)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> dict[str, Any]:
        """{"buckets": [(le, cumulative count)...], "sum": s, "count": n} (the last `le` is inf)."""
        running, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            running += count
            buckets.append((bound, running))
        return {"buckets": buckets, "sum": self.total, "count": running}


BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
QUEUE_WAIT_BOUNDS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class BatchStats:
    """Per replica: samples per step and the time each request waited in the queue."""

    def __init__(self) -> None:
        self.batch_size = Histogram(BATCH_SIZE_BOUNDS)
        self.queue_wait = Histogram(QUEUE_WAIT_BOUNDS)

    def record(self, samples: int, waits: list[float]) -> None:
        self.batch_size.observe(samples)
        for wait in waits:
            self.queue_wait.observe(wait)

    def record_one(self, samples: int, wait: float) -> None:
        self.batch_size.observe(samples)
        self.queue_wait.observe(wait)

    def record_here(self, wait: float) -> None:
        """`record_one(1, wait)` for the inline fast path, without its calls."""
        sizes, waits = self.batch_size, self.queue_wait
        sizes.counts[0] += 1  # a batch of 1 falls in the first bucket (le=1)
        sizes.total += 1
        waits.counts[bisect.bisect_left(waits.bounds, wait)] += 1
        waits.total += wait

    def snapshot(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size.snapshot(), "queue_wait_seconds": self.queue_wait.snapshot()}
