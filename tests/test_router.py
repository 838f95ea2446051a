"""The group router's own accounting, without Serve running: pure tests of `FewestInFlightRouter`.

Run: .venv/bin/pytest tests/test_router.py -q

The router is Serve's own `RequestRouter` subclass, built here with a queue-length cache and
driven through the hooks Serve calls (choose_replicas, on_send_request, on_new_queue_len_info,
on_request_routed, on_request_completed) in the order Serve's router calls them. The replicas and
pending requests are fakes (`FakeReplica`, `FakePending`): only the fields the router reads.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID  # noqa: E402
from ray.serve.request_router import ReplicaID  # noqa: E402

from phyai_ray.serve.runtime.router import ChosenRequests, FewestInFlightRouter  # noqa: E402

_ids = itertools.count()


class FakeReplica:
    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="ReplicaGroup", app_name="t"))
        self.routing_stats: dict[str, Any] = {}
        self.max_ongoing_requests = 1000


def FakePending() -> Any:
    return SimpleNamespace(kwargs={}, metadata=SimpleNamespace(internal_request_id=f"r{next(_ids)}"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_router(clock: Clock | None = None) -> FewestInFlightRouter:
    router = FewestInFlightRouter(deployment_id=DeploymentID(name="ReplicaGroup", app_name="t"),
                                  handle_source=DeploymentHandleSource.PROXY, use_replica_queue_len_cache=True,
                                  get_curr_time_s=clock)
    router.initialize_state()
    return router


async def choose(router: FewestInFlightRouter, groups: list[FakeReplica], pending: Any) -> FakeReplica:
    return (await router.choose_replicas(groups, pending))[0][0]


@pytest.mark.parametrize("n", [2, 4, 8, 9, 64])
def test_a_burst_of_choices_spreads_evenly_over_groups_with_equal_counts(n: int) -> None:
    """N routing tasks choose before any of them is sent (Serve sends after the choice returns)."""
    groups = [FakeReplica("a"), FakeReplica("b")]

    async def burst() -> Counter:
        router = make_router()
        chosen = await asyncio.gather(*(choose(router, groups, FakePending()) for _ in range(n)))
        return Counter(g.replica_id.unique_id for g in chosen)

    spread = asyncio.run(burst())
    assert sum(spread.values()) == n and max(spread.values()) - min(spread.get("a", 0), spread.get("b", 0)) <= 1


def test_a_burst_over_three_groups_fills_the_emptiest_first() -> None:
    groups = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]

    async def burst() -> Counter:
        router = make_router()
        for _ in range(3):  # three requests already open on a, as the group said
            router.on_new_queue_len_info(groups[0].replica_id, 3)
        chosen = await asyncio.gather(*(choose(router, groups, FakePending()) for _ in range(7)))
        return Counter(g.replica_id.unique_id for g in chosen)

    assert asyncio.run(burst()) == Counter({"b": 3, "c": 3, "a": 1})  # final counts 4, 3, 3


def serve_one(router: FewestInFlightRouter, pending: Any, group: FakeReplica, exact: int) -> None:
    """What Serve's router does after a choice: send, hear the group's exact count, routed."""
    router.on_send_request(group.replica_id)
    router.on_new_queue_len_info(group.replica_id, exact)
    router.on_request_routed(pending, group.replica_id, None)


def test_open_sessions_keep_counting_after_serves_queue_view_forgets_them() -> None:
    clock = Clock()
    groups = [FakeReplica("a"), FakeReplica("b")]

    async def scenario() -> list[str]:
        router = make_router(clock)
        order = []
        for i in range(4):  # four sessions, one after another: a, b, a, b
            pending = FakePending()
            group = await choose(router, groups, pending)
            serve_one(router, pending, group, exact=i // 2 + 1)
            order.append(group.replica_id.unique_id)
        clock.now += 60  # Serve's cache entries are stale now: the sessions are still open
        late = FakePending()
        assert router.in_flight(groups[0].replica_id) == 2 and router.in_flight(groups[1].replica_id) == 2
        order.append((await choose(router, groups, late)).replica_id.unique_id)
        return order

    order = asyncio.run(scenario())
    assert order[:4] in (["a", "b", "a", "b"], ["b", "a", "b", "a"]) and order[4] == order[0]


def test_a_finished_request_stops_counting_and_a_choice_sent_elsewhere_releases_its_reservation() -> None:
    a, b = FakeReplica("a"), FakeReplica("b")

    async def scenario() -> None:
        router = make_router()
        first = FakePending()
        assert (await choose(router, [a, b], first)) is a  # ties: the first one
        assert router.in_flight(a.replica_id) == 1 and router.in_flight(b.replica_id) == 0
        # a had no room, Serve sent it to b instead: a's reservation goes with the routed callback
        serve_one(router, first, b, exact=1)
        assert router.in_flight(a.replica_id) == 0 and router.in_flight(b.replica_id) == 1
        router.on_request_completed(b.replica_id, first.metadata.internal_request_id)
        router.decrement_queue_len_cache(b.replica_id)
        assert router.in_flight(b.replica_id) == 0
        failed = FakePending()  # chosen, then the send raised: Serve reports it completed
        chosen = await choose(router, [a, b], failed)
        router.on_request_completed(chosen.replica_id, failed.metadata.internal_request_id)
        assert router.in_flight(a.replica_id) == 0 and router.in_flight(b.replica_id) == 0

    asyncio.run(scenario())


def test_sent_but_not_yet_routed_counts_once() -> None:
    a, b = FakeReplica("a"), FakeReplica("b")

    async def scenario() -> None:
        router = make_router()
        p1, p2 = FakePending(), FakePending()
        assert (await choose(router, [a, b], p1)) is a and (await choose(router, [a, b], p2)) is b
        router.on_send_request(a.replica_id)  # Serve's cache +1; the reservation stops counting
        assert router.in_flight(a.replica_id) == 1
        router.on_request_routed(p1, a.replica_id, None)
        assert router.in_flight(a.replica_id) == 1 and router.in_flight(b.replica_id) == 1

    asyncio.run(scenario())


def test_an_exact_count_that_lags_sends_on_their_way_does_not_hide_them() -> None:
    """A group's exact count (returned as it accepts a request) can predate requests already sent to it."""
    a, b = FakeReplica("a"), FakeReplica("b")

    async def scenario() -> list[str]:
        router = make_router()
        burst = [FakePending() for _ in range(4)]
        chosen = [await choose(router, [a, b], p) for p in burst]
        for pending, group in zip(burst, chosen):
            router.on_send_request(group.replica_id)
        first_a = burst[[g.replica_id.unique_id for g in chosen].index("a")]
        router.on_new_queue_len_info(a.replica_id, 1)  # a accepted its first; its second is still on its way
        router.on_request_routed(first_a, a.replica_id, None)
        assert router.in_flight(a.replica_id) == 2 and router.in_flight(b.replica_id) == 2
        return [(await choose(router, [a, b], FakePending())).replica_id.unique_id for _ in range(2)]

    assert sorted(asyncio.run(scenario())) == ["a", "b"]


def test_a_reservation_nobody_reports_back_expires() -> None:
    clock = Clock()
    chosen = ChosenRequests(clock)
    chosen.reserve("lost", "a")
    assert chosen.count("a") == 1
    clock.now += 31
    chosen.reserve("next", "b")
    assert chosen.count("a") == 0 and chosen.count("b") == 1


def test_without_completion_reports_a_routed_request_is_left_to_serves_view() -> None:
    chosen = ChosenRequests(track_open=False)
    chosen.reserve("r", "a")
    assert chosen.count("a") == 1
    chosen.routed("r", "a")
    assert chosen.count("a") == 0  # nothing would ever release it: Serve's queue view counts it instead
