"""Failover at once: a request a failed group refuses reaches a healthy group at once; it waits only
while no group is healthy, and then no longer than its deadline.

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_failover.py -q

The first tests drive `GroupRunner` with a stand-in engine and a registry view written by hand (no
Ray). The last one runs a real Serve app of 2 groups x TP=2, kills a rank while 4 clients send
without pause, and measures every answer from the kill.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import pytest

from phyai_ray.errors import EngineUnavailableError
from phyai_ray.serve.runtime.registry import GroupReport, set_failed, takers
from phyai_ray.serve.runtime.holder import EngineHolder
from phyai_ray.serve.runtime.runner import GroupRunner
from tests.conftest import closed_without_leaks, delete_serve_apps, shared_serve
from tests.helpers import post_step, wait_until
from tests.test_serve_http import StepEngine

DOWN = dict(at_submit=EngineUnavailableError("group failed", reason="worker_exit"), healthy=False)


class Down(StepEngine):
    def submit(self, request: Any, **deadline: Any) -> Any:  # refuses at once, as a failed group does
        return super().submit(request)


def report(group: str, state: str, reason: str | None = None) -> GroupReport:
    return GroupReport(group=group, state=state, world_size=2, failure_reason=reason)


def failed_runner(group: str, view: list[GroupReport], sent: list) -> GroupRunner:
    async def forward(request: Any, hops: int, failed: tuple, **deadline: Any) -> Any:
        sent.append((time.monotonic(), failed))
        return {"from": "peer"}

    runner = GroupRunner(EngineHolder(lambda: Down(**DOWN)), group=group, wait_s=10, forward=forward)
    runner.view = view
    return runner


def test_takers_are_the_serving_groups_the_request_has_not_passed() -> None:
    view = [report("a", "failed"), report("b", "serving"), report("c", "starting"), report("d", "gone")]
    assert [r.group for r in takers(view, ("a",))] == ["b"]
    assert takers(view, ("a", "b")) == []  # none healthy: wait for Serve
    assert takers([], ("a",)) is None  # no view yet: the router decides
    set_failed("b", True)  # failed in this very process, before the registry knows
    try:
        assert takers(view, ("a",)) == []
    finally:
        set_failed("b", False)


def test_a_failed_group_forwards_at_once_while_another_group_is_healthy() -> None:
    sent: list = []
    runner = failed_runner("f1", [report("f1", "serving"), report("h1", "serving")], sent)  # its own row is stale
    try:
        began = time.monotonic()
        assert asyncio.run(runner.run({"x": [1.0]})) == {"from": "peer"}
        assert sent[0][0] - began < 0.1 and sent[0][1] == ("f1",), sent
    finally:
        set_failed("f1", False)


def test_with_no_healthy_group_a_forwarded_request_waits_its_deadline_then_503_names_the_groups() -> None:
    sent: list = []
    view = [report("f2", "failed"), report("g2", "failed", "worker_exit"), report("s2", "starting")]
    runner = failed_runner("f2", view, sent)
    try:
        began = time.monotonic()
        with pytest.raises(EngineUnavailableError) as caught:
            asyncio.run(runner.run({"x": [1.0]}, deadline_s=0.3))
        waited = time.monotonic() - began
        assert 0.25 <= waited < 0.8, waited  # its deadline, not FORWARD_WAIT_S
        assert caught.value.reason == "no_healthy_replica" and sent == []  # never routed to a failed group
        assert "g2: failed (worker_exit)" in str(caught.value) and "s2: starting" in str(caught.value)
        runner.wait_s = 0.2  # no deadline: the bounded wait (min(wait_s, FORWARD_WAIT_S)), then the same 503
        with pytest.raises(EngineUnavailableError, match="no healthy group took the request"):
            asyncio.run(runner.run({"x": [1.0]}))
    finally:
        set_failed("f2", False)


def test_a_waiting_forwarded_request_goes_as_soon_as_a_group_is_healthy() -> None:
    sent: list = []
    view = [report("f3", "failed"), report("s3", "starting")]
    runner = failed_runner("f3", view, sent)

    async def main() -> Any:
        async def serving_later() -> None:
            await asyncio.sleep(0.2)
            runner.view = [report("f3", "failed"), report("s3", "serving")]

        later = asyncio.ensure_future(serving_later())
        began = time.monotonic()
        result = await runner.run({"x": [1.0]}, deadline_s=5.0)
        await later
        return result, sent[0][0] - began

    try:
        result, after = asyncio.run(main())
        assert result == {"from": "peer"} and 0.19 <= after < 0.5, after
    finally:
        set_failed("f3", False)


# -- a real Serve app ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def port() -> Any:
    from ray import serve

    port = shared_serve()["port"]
    yield from closed_without_leaks(port, delete_serve_apps)


def groups(base: str) -> list[dict]:
    import requests

    return requests.get(f"{base}/v1/replicas", timeout=30).json()["replicas"]


def two_groups(base: str, names: set[str] = frozenset(), state: str | None = None) -> list[dict] | None:
    """One /v1/replicas answer when it lists two groups (with `state`: `names` all in it), else None."""
    listed = groups(base)
    if len(listed) != 2 or (state is not None and not {g["group"] for g in listed if g["state"] == state} >= names):
        return None
    return listed


def in_state(base: str, names: set[str], state: str) -> bool:
    return {g["group"] for g in groups(base) if g["state"] == state} >= names


class Clients:
    """`n` clients sending /v1/step without pause; every answer kept as (sent, answered, status, body)."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.stop, self.answers = url, threading.Event(), []
        self.threads = [threading.Thread(target=self._send, daemon=True) for _ in range(n)]
        for thread in self.threads:
            thread.start()

    def _send(self) -> None:
        import torch

        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                reply = post_step(self.url, {"x": torch.ones(1, 8)}, timeout_s=30, sleep_s=0.02)
                self.answers.append((sent, time.monotonic(), reply.status_code, reply.text))
            except Exception as exc:  # no answer at all (a client timeout): the test fails on it
                self.answers.append((sent, time.monotonic(), None, repr(exc)))

    def join(self) -> list[tuple]:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        return self.answers


def test_a_killed_rank_costs_no_request_more_than_2s_and_a_deadline_bounds_the_wait_when_none_is_healthy(
        port: int) -> None:
    from ray import serve

    from phyai_ray import DenseParallelConfig, DeploymentConfig, EngineArgs, EngineConfig, ParallelConfig
    from phyai_ray.config.deployment import WorkerSupervisorConfig
    from phyai_ray.config.engine import DeviceConfig
    from phyai_ray.serve import create_app

    args = EngineArgs(plugin="tests.plugins.serve_plugins:ServeRowTPEntry", config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    deployment = DeploymentConfig.local(replica_count=2, cpus_per_rank=0.5, process_config=WorkerSupervisorConfig(
        startup_timeout_s=120, execution_timeout_s=30))
    # health checks every 60 s: Serve leaves a failed group failed (not replaced) while the test runs
    serve.run(create_app(args, deployment, health_check_period_s=60), name="failover", route_prefix="/failover")
    base = f"http://127.0.0.1:{port}/failover"
    try:
        # each check reads ONE answer: each group's view of the other refreshes on its own clock, so a second
        # request may land on a group whose view does not list the other yet
        names = {g["group"] for g in wait_until(lambda: two_groups(base), 60, "2 groups")}
        listed = wait_until(lambda: two_groups(base, names, "serving"), 60, "both groups serving")
        victim, other = sorted(listed, key=lambda g: g["group"])
        clients = Clients(base, 4)
        time.sleep(1.0)  # traffic on both groups
        killed = time.monotonic()
        os.kill(victim["pids"][1], signal.SIGKILL)
        wait_until(lambda: in_state(base, {victim["group"]}, "failed"), 30, "the killed rank's group to fail")
        failed_seen = time.monotonic()
        time.sleep(3.0)  # requests the proxy still sends to the failed group are forwarded
        answers = clients.join()
        _check_failover(answers, killed, failed_seen)
        assert in_state(base, {other["group"]}, "serving")

        os.kill(other["pids"][1], signal.SIGKILL)  # now no group is healthy
        wait_until(lambda: in_state(base, names, "failed"), 30, "both groups to fail")
        sent = time.monotonic()
        reply = _deadline_step(base)
        waited = time.monotonic() - sent
        assert waited < 1.5 + 0.5, (waited, reply.status_code, reply.text)  # its 1.5 s deadline, not 30 s
        assert reply.status_code in (503, 504), reply.text
        if reply.status_code == 503:
            assert "no healthy group" in reply.text and "failed" in reply.text, reply.text
    finally:
        serve.delete("failover")


def _deadline_step(base: str) -> Any:
    import requests

    return requests.post(f"{base}/v1/step", json={"x": [[1.0] * 8]}, headers={"X-Request-Deadline-Ms": "1500"},
                         timeout=30)


def _check_failover(answers: list[tuple], killed: float, failed_seen: float) -> None:
    """Every request answered, none waiting more than 2 s counted from the kill; every request sent
    after the group reported itself failed succeeded (forwarded, or routed past it)."""
    waits = [(answered - max(sent, killed), status, body[:200]) for sent, answered, status, body in answers
             if answered > killed]
    assert waits and all(status is not None for _, status, _ in waits), [w for w in waits if w[1] is None]
    worst = max(waits)
    assert worst[0] <= 2.0, f"a request waited {worst[0]:.2f}s after the kill: {worst}"
    late = [(status, body) for sent, _, status, body in answers if sent > failed_seen and status != 200]
    assert not late, late[:3]
    refused = [body for _, status, body in waits if status != 200]
    assert all("no_healthy_replica" not in body for body in refused), refused[:3]
    print(f"failover: {len(waits)} answers after the kill, worst wait {worst[0]:.3f}s, "
          f"{len(refused)} failed in flight")
