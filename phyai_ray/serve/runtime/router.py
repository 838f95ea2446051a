"""`FewestInFlightRouter`: the Serve request router of the replica-group deployment.

Each request goes to the healthy group with the fewest requests in flight; ties go to the group
chosen least recently; a group known to have failed is never chosen. Built on Serve's public
`ray.serve.request_router` API and named in the deployment's `RequestRouterConfig`, so the HTTP
proxy and every `DeploymentHandle` of the deployment (other apps, tasks, actors) route alike.

    in flight: {A: 2, B: 0, C: 0}, B chosen at t=5, C at t=3   ->  candidates [[C], [B], [A]]

`choose_replicas` returns one group per rank, best first. Serve then sends the request to the
first rank whose group has room (`in flight < max_ongoing_requests`), probing a group whose count
it does not know. "In flight" of a group, as this router sees it, is the larger of

* Serve's queue-length view: requests this router sent and that have not finished (+1 on send,
  -1 on completion), corrected by the exact count a group returns with each request it accepts
  and by probes; it holds other routers' requests too, but lags (a count a group returns does not
  yet hold the requests still on their way to it) and forgets an entry after a few seconds;
* this router's own count (`ChosenRequests`): every request it chose the group for, from the moment of the
  choice until Serve reports it routed, and then until it completes. Serve runs several routing
  tasks at once and sends a chosen request only after the choice returns, so without counting at
  choice time a burst of N requests (N robots reconnecting after a restart) would all see the
  same counts and all pick the same group; with it they spread as evenly as the counts allow, and
  ties rotate at choice time. A long-lived session (an openpi WebSocket, a streamed response)
  counts for as long as it is open, never forgotten.

    two idle groups, four sessions arrive together:  A, B, A, B   (not A, A, A, A)

A group is known failed when its `record_routing_stats` says so (Serve's controller polls it every
`request_routing_stats_period_s`), when it failed in this very process (`mark_failed`), and Serve
drops it once its health check fails.

Several proxies (one per node) and handles each run their own router: each counts exactly what it
chose and has open, and learns other routers' requests only from the counts groups return (on every
accepted request and on probes). So with N routers a choice can miss the requests the others sent
to a group since it last returned a count here, and, while this router's own count is the larger,
the others' share of that group. Ties and failures are judged the same everywhere.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Any, Callable, Hashable, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# Serve pickles this module BY VALUE into every proxy and handle, so state shared with the group
# deployment in the same process lives in `registry` (pickled by reference).
from phyai_ray.serve.runtime.registry import FAILED_STAT, failed_here

RESERVATION_TTL_S = 30.0  # a choice Serve never reported back (a bug, a lost callback) stops counting then
# Serve versions without the hook never say when a routed request ends: there the router's own count
# covers its choices until routed only, and Serve's view does the rest.
SERVE_REPORTS_COMPLETION = "on_request_completed" in vars(RequestRouter)


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


class ChosenRequests:
    """A router's own account per group: what it chose and has not heard back of, and what is still open.

        chosen.reserve("r1", A)     # chosen: A counts one more at once (before Serve even sends it)
        chosen.routed("r1", A)      # A accepted r1 (wherever it was reserved): open on A until...
        chosen.completed("r1", A)   # ...it finished, failed or was refused: it counts no more

    `count(A)` is exact for this router's own requests: a choice counts from the moment it is made
    until Serve reports the request routed (then it is open) or completed; choosing again for a
    request (a retry) moves its reservation. A reservation nobody reported back expires after
    RESERVATION_TTL_S. Pure: no Serve; pass a clock.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, track_open: bool = True) -> None:
        self._clock, self._track_open = clock, track_open
        self._pending: dict[Hashable, tuple[Hashable, float]] = {}  # request -> (group, when chosen)
        self._open: dict[Hashable, Hashable] = {}  # request -> group it is open on
        self._counts: Counter = Counter()  # group -> pending + open requests

    def reserve(self, request: Hashable, group: Hashable) -> None:
        self.expire()
        self._drop_pending(request)
        self._pending[request] = (group, self._clock())
        self._counts[group] += 1

    def routed(self, request: Hashable, group: Hashable) -> None:
        self._drop_pending(request)
        if self._track_open and request not in self._open:
            self._open[request] = group
            self._counts[group] += 1

    def completed(self, request: Hashable, group: Hashable) -> None:
        self._drop_pending(request)
        was = self._open.pop(request, None)
        if was is not None:
            self._counts[was] -= 1

    def count(self, group: Hashable) -> int:
        """This router's requests on `group`: chosen and not yet heard back of, plus routed and still open."""
        return self._counts[group]

    def expire(self) -> None:
        horizon = self._clock() - RESERVATION_TTL_S
        for request in [r for r, (_, at) in self._pending.items() if at < horizon]:
            self._drop_pending(request)

    def _drop_pending(self, request: Hashable) -> None:
        entry = self._pending.pop(request, None)
        if entry is not None:
            self._counts[entry[0]] -= 1


class FewestInFlightRouter(RequestRouter):
    """Fewest in flight first, ties to the least recently chosen, never a group known failed."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._last_chosen: dict[ReplicaID, int] = {}
        self._clock = itertools.count()
        self._chosen = ChosenRequests(track_open=SERVE_REPORTS_COMPLETION)

    def in_flight(self, replica_id: ReplicaID) -> int:
        """Serve's queue view of the group (other routers' requests included), or this router's own
        count when that is more (the view lags a send, forgets after a few seconds, and an exact count
        a group returns does not yet hold the requests still on their way to it)."""
        return max(self.replica_queue_len_cache.get(replica_id) or 0, self._chosen.count(replica_id))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        counts = {r.replica_id: self.in_flight(r.replica_id) for r in candidate_replicas}
        forwarded = pending_request is not None and bool(pending_request.kwargs.get("hops"))
        ranked = rank_groups(candidate_replicas, counts, self._last_chosen, forwarded)
        if ranked and pending_request is not None:
            best = ranked[0].replica_id
            self._chosen.reserve(_request_key(pending_request), best)
            self._last_chosen[best] = next(self._clock)
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._chosen.routed(_request_key(pending_request), replica_id)
        self._last_chosen[replica_id] = next(self._clock)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._chosen.completed(internal_request_id, replica_id)


def _request_key(pending_request: PendingRequest) -> Hashable:
    return pending_request.metadata.internal_request_id
