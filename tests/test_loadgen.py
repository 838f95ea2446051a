"""benchmarks/loadgen.py: traces a seed replays, open-loop sending, and the goodput report.

Run: `.venv/bin/python -m pytest tests/test_loadgen.py -q` (inline engines, no Ray).
"""

from __future__ import annotations

import statistics

import pytest

from benchmarks.loadgen import (Arrival, RequestClass, engine_sender, fingerprint, http_sender, periodic, poisson,
                                report, run)
from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig

SHORT = RequestClass("short", 0.8, lambda rng, i: {"state": [rng.uniform(-1, 1) for _ in range(8)], "step": i}, 1.0)
LONG = RequestClass("long", 0.2, lambda rng, i: {"state": [0.5] * 8, "step": i})


def test_a_seed_replays_the_same_trace_and_another_seed_does_not():
    first, again, other = (poisson(50.0, 4.0, [SHORT, LONG], seed) for seed in (7, 7, 8))
    assert fingerprint(first) == fingerprint(again) and first == again
    assert fingerprint(first) != fingerprint(other)
    robots = [periodic(4, 20.0, 2.0, 0.005, SHORT, 3) for _ in range(2)]
    assert fingerprint(robots[0]) == fingerprint(robots[1])


def test_poisson_keeps_its_rate_and_shares_and_periodic_its_period_within_the_jitter():
    trace = poisson(200.0, 20.0, [SHORT, LONG], seed=1)
    assert abs(len(trace) / 20.0 - 200.0) < 200.0 * 0.05  # 4,000 expected; sd about 63
    assert abs(sum(a.cls == "long" for a in trace) / len(trace) - 0.2) < 0.03
    gaps = [b.at - a.at for a, b in zip(trace, trace[1:])]
    assert abs(statistics.mean(gaps) - 1 / 200.0) < 0.1 / 200.0 and all(g >= 0 for g in gaps)
    robots = periodic(3, 10.0, 5.0, 0.004, SHORT, seed=2)
    by_client: dict[int, list[float]] = {}
    for a in robots:
        by_client.setdefault(a.request["step"], []).append(a.at)
    assert sorted(by_client) == [0, 1, 2] and all(49 <= len(t) <= 51 for t in by_client.values())
    for times in by_client.values():
        assert all(abs((b - a) - 0.1) <= 0.008 + 1e-9 for a, b in zip(times, times[1:]))


@pytest.fixture(scope="module")
def policy():
    args = EngineArgs(plugin="reference_flow_policy", plugin_args={"seed": 0},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    with Engine(args, DeploymentConfig(mode="inline")) as engine:
        yield engine


def test_an_open_loop_run_reports_every_request_once_per_class(policy):
    """1.5 s of 8 robots at 20 Hz against an inline engine: every request has one outcome, goodput is met
    requests per second of the trace, and a request that cannot be decoded counts as an error, not a hang."""
    trace = periodic(8, 20.0, 1.5, 0.005, SHORT, seed=4)
    trace.append(Arrival(1.5, "long", len(trace), {"state": "not a list"}))
    outcomes = run(trace, engine_sender(policy, [SHORT, LONG], deadlines=True), [SHORT, LONG], timeout_s=60)
    table = report(outcomes, [SHORT, LONG], 1.5)
    assert table["short"]["sent"] == len(trace) - 1 and table["long"]["sent"] == 1
    assert table["short"]["answered"] + sum(table["short"]["errors"].values()) == table["short"]["sent"]
    assert table["short"]["goodput"] == pytest.approx(table["short"]["met"] / 1.5)
    assert table["short"]["p50_s"] <= table["short"]["p95_s"] <= table["short"]["p99_s"] <= 1.0
    assert table["short"]["met"] >= 0.9 * table["short"]["sent"], table
    assert table["long"]["answered"] == 0 and sum(table["long"]["errors"].values()) == 1


def test_the_http_driver_sends_the_same_trace_through_v1_step(policy):
    from starlette.testclient import TestClient

    from phyai_ray.serve.protocols.http import create_api
    from phyai_ray.serve.runtime.holder import EngineHolder
    from phyai_ray.serve.runtime.options import ServeOptions
    from phyai_ray.serve.runtime.runner import GroupRunner

    trace = poisson(40.0, 1.0, [SHORT], seed=5)
    with TestClient(create_api(GroupRunner(EngineHolder(lambda: policy)), ServeOptions(api_key="k"))) as http:
        outcomes = run(trace, http_sender("http://testserver", "k", workers=8, client=http), [SHORT], timeout_s=60)
        table = report(outcomes, [SHORT], 1.0)
        assert table["short"]["answered"] == len(trace) and not table["short"]["errors"], table
        refused = run(trace[:2], http_sender("http://testserver", "wrong", workers=2, client=http), [SHORT], 60)
        assert [o.error for o in refused] == ["RuntimeError", "RuntimeError"]
