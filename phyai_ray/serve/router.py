"""`FewestInFlightRouter`: the Serve request router of the replica-group deployment.

Each request goes to the healthy group with the fewest requests in flight; ties go to the group
chosen least recently; a group known to have failed is never chosen. Built on Serve's public
`ray.serve.request_router` API and named in the deployment's `RequestRouterConfig`, so the HTTP
proxy and every `DeploymentHandle` of the deployment (other apps, tasks, actors) route alike.

    in flight: {A: 2, B: 0, C: 0}, B chosen at t=5, C at t=3   ->  candidates [[C], [B], [A]]

`choose_replicas` returns one group per rank, best first. Serve then sends the request to the
first rank whose group has room (`in flight < max_ongoing_requests`), probing a group whose count
it does not know. "In flight" of a group, as this router sees it, is the sum of

* Serve's queue-length view: requests this router sent and that have not finished (+1 on send,
  -1 on completion), corrected by the exact count a group returns with each request it accepts
  and by probes. Serve forgets an entry after a few seconds without news;
* the requests this router sent there that are still open, when that is more: a long-lived
  session (an openpi WebSocket, a streamed response) counts for as long as it is open, never
  forgotten;
* this router's own choices not yet sent: a reservation is taken the moment a group is chosen and
  released when the request is sent, routed elsewhere or fails. Serve runs several routing tasks
  at once and sends a chosen request only after the choice returns, so without it a burst of N
  requests (N robots reconnecting after a restart) would all see the same counts and all pick the
  same group; with it they spread as evenly as the counts allow, and ties rotate at choice time.

    two idle groups, four sessions arrive together:  A, B, A, B   (not A, A, A, A)

A group is known failed when its `record_routing_stats` says so (Serve's controller polls it every
`request_routing_stats_period_s`), when it failed in this very process (`mark_failed`), and Serve
drops it once its health check fails.

Several proxies (one per node) and handles each run their own router: each counts exactly what it
sent and chose, and learns other routers' requests only from the counts groups return (on every
accepted request and on probes). So with N routers a choice can lag by the requests the others
sent since this router last heard from that group; at most one such request per other router and
group while they all route concurrently. Ties and failures are judged the same everywhere.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Any, Callable, Hashable, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# Serve pickles this module BY VALUE into every proxy and handle, so state shared with the group
# deployment in the same process lives in `registry` (pickled by reference).
from phyai_ray.serve.registry import FAILED_STAT, failed_here

RESERVATION_TTL_S = 30.0  # a choice Serve never reported back (a bug, a lost callback) stops counting then


def known_failed(replica: Any) -> bool:
    stats = replica.routing_stats or {}
    return bool(stats.get(FAILED_STAT)) or failed_here(replica.replica_id.unique_id)


def rank_groups(replicas: List[Any], in_flight: dict, last_chosen: dict, forwarded: bool = False) -> List[Any]:
    """Healthy groups by (in flight, least recently chosen); an unknown count sorts as 0 (and is probed).

    When every group is known failed: a new request goes to one of them anyway (it answers at
    once: it forwards, or 503 with Retry-After); a request a failed group forwards gets none, so
    it waits in the router (Serve retries with backoff) until Serve brings a healthy group up.
    """
    healthy = [r for r in replicas if not known_failed(r)] or ([] if forwarded else list(replicas))
    return sorted(healthy, key=lambda r: (in_flight.get(r.replica_id) or 0, last_chosen.get(r.replica_id, -1)))


class Ledger:
    """A router's own account per group: choices not yet sent (reservations) and requests still open.

        ledger.reserve("r1", A)     # chosen: A counts one more at once
        ledger.sent(A)              # Serve sent a request to A: its queue view now has it, the reservation stops
        ledger.routed("r1", A)      # A accepted r1: r1 is open on A until ledger.completed("r1", A)

    `sent` names only the group (Serve's hook says no more), so it marks one reservation of that
    group as counted elsewhere; the reservation itself goes when its request is routed or
    completes. A request sent elsewhere than it was reserved drops its reservation then too, and
    a reservation nobody reported back expires after RESERVATION_TTL_S. Pure: no Serve; pass a clock.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pending: dict[Hashable, tuple[Hashable, float]] = {}  # request -> (group, when chosen)
        self._waiting: Counter = Counter()  # group -> reservations
        self._sent: Counter = Counter()  # group -> of those, how many Serve's queue view already holds
        self._open: dict[Hashable, Hashable] = {}  # request -> group it is open on
        self._open_count: Counter = Counter()

    def reserve(self, request: Hashable, group: Hashable) -> None:
        self.expire()
        self._drop(request)
        self._pending[request] = (group, self._clock())
        self._waiting[group] += 1

    def sent(self, group: Hashable) -> None:
        if self._waiting[group] > self._sent[group]:
            self._sent[group] += 1

    def routed(self, request: Hashable, group: Hashable) -> None:
        self._drop(request, group)
        if request not in self._open:
            self._open[request] = group
            self._open_count[group] += 1

    def completed(self, request: Hashable, group: Hashable) -> None:
        self._drop(request, group)
        was = self._open.pop(request, None)
        if was is not None:
            self._open_count[was] -= 1

    def reserved(self, group: Hashable) -> int:
        """Choices of `group` that no other count holds yet."""
        return self._waiting[group] - self._sent[group]

    def open(self, group: Hashable) -> int:
        return self._open_count[group]

    def expire(self) -> None:
        horizon = self._clock() - RESERVATION_TTL_S
        for request in [r for r, (_, at) in self._pending.items() if at < horizon]:
            self._drop(request)

    def _drop(self, request: Hashable, went_to: Hashable | None = None) -> None:
        entry = self._pending.pop(request, None)
        if entry is None:
            return
        group = entry[0]
        self._waiting[group] -= 1
        if self._sent[group] > 0 and (group == went_to or self._sent[group] > self._waiting[group]):
            self._sent[group] -= 1  # it was one of the sent ones (or the count would exceed the reservations)


class FewestInFlightRouter(RequestRouter):
    """Fewest in flight first, ties to the least recently chosen, never a group known failed."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._last_chosen: dict[ReplicaID, int] = {}
        self._clock = itertools.count()
        self._ledger = Ledger()

    def in_flight(self, replica_id: ReplicaID) -> int:
        queue_view = self.replica_queue_len_cache.get(replica_id) or 0
        return max(queue_view, self._ledger.open(replica_id)) + self._ledger.reserved(replica_id)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        counts = {r.replica_id: self.in_flight(r.replica_id) for r in candidate_replicas}
        forwarded = pending_request is not None and bool(pending_request.kwargs.get("hops"))
        ranked = rank_groups(candidate_replicas, counts, self._last_chosen, forwarded)
        if ranked and pending_request is not None:
            best = ranked[0].replica_id
            self._ledger.reserve(_request_key(pending_request), best)
            self._last_chosen[best] = next(self._clock)
        return [[r] for r in ranked]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._ledger.sent(replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._ledger.routed(_request_key(pending_request), replica_id)
        self._last_chosen[replica_id] = next(self._clock)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ledger.completed(internal_request_id, replica_id)


def _request_key(pending_request: PendingRequest) -> Hashable:
    return pending_request.metadata.internal_request_id
