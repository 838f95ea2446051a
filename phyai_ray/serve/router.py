"""`FewestInFlightRouter`: the Serve request router of the replica-group deployment.

Each request goes to the healthy group with the fewest requests in flight; ties go to the group
chosen least recently; a group known to have failed is never chosen. Built on Serve's public
`ray.serve.request_router` API and named in the deployment's `RequestRouterConfig`, so the HTTP
proxy and every `DeploymentHandle` of the deployment (other apps, tasks, actors) route alike.

    in flight: {A: 2, B: 0, C: 0}, B chosen at t=5, C at t=3   ->  candidates [[C], [B], [A]]

`choose_replicas` returns one group per rank, best first. Serve then sends the request to the
first rank whose group has room (`in flight < max_ongoing_requests`), probing a group whose count
it does not know. "In flight" is Serve's queue-length view of each group: requests this router
sent and that have not finished (+1 on send, -1 on completion), corrected by the exact count a
group returns with each request it accepts and by probes. A group is known failed when its
`record_routing_stats` says so (Serve's controller polls it every `request_routing_stats_period_s`),
when it failed in this very process (`mark_failed`), and Serve drops it once its health check fails.

Several proxies (one per node) and handles each run their own router: each counts exactly what
it sent, and learns other routers' requests only from the counts groups return (on every
accepted request and on probes). So with N routers a choice can lag by the requests the others
sent since this router last heard from that group; at most one such request per other router
and group while they all route concurrently. Ties and failures are judged the same everywhere.
"""

from __future__ import annotations

import itertools
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# Serve pickles this module BY VALUE into every proxy and handle, so state shared with the group
# deployment in the same process lives in `registry` (pickled by reference).
from phyai_ray.serve.registry import FAILED_STAT, failed_here


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


class FewestInFlightRouter(RequestRouter):
    """Fewest in flight first, ties to the least recently chosen, never a group known failed."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._last_chosen: dict[ReplicaID, int] = {}
        self._clock = itertools.count()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        cache = self.replica_queue_len_cache
        counts = {r.replica_id: cache.get(r.replica_id) for r in candidate_replicas}
        forwarded = pending_request is not None and bool(pending_request.kwargs.get("hops"))
        return [[r] for r in rank_groups(candidate_replicas, counts, self._last_chosen, forwarded)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._last_chosen[replica_id] = next(self._clock)
