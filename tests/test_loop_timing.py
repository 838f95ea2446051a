"""Each continuous-batching iteration's host work is measured apart from its forward (executors/loop_timing.py).

Behaviour, not speed: a plugin that sleeps in its forward and elsewhere in iterate() shows each sleep in its
own part; the histograms the HTTP edge exports hold one sample per iteration.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig, Entry, register_plugin
from phyai_ray.executors.loop_timing import IterationTimes
from phyai_ray.plugins.iteration import Deltas, RankTiming, SequenceSpec
from phyai_ray.serve.runtime.metrics import _BatchCollector
from tests.plugins.null_loop import NullLoop
from tests.plugins.iterating import IterProbeEntry

HOST_S, FORWARD_S = 0.01, 0.02


class TimedLoop(NullLoop):
    """null_loop's sequences; each iterate(): HOST_S of work around the forward, then a FORWARD_S forward it
    reports."""

    def iterate(self) -> Deltas:
        time.sleep(HOST_S)
        started = time.perf_counter()
        time.sleep(FORWARD_S)
        forward = time.perf_counter() - started
        return Deltas(super().iterate(), forward_s=forward)


@register_plugin
class TimedLoopEntry(Entry):
    name = "timed_loop"

    def sequences(self, request: dict[str, Any]) -> list[SequenceSpec]:
        return [SequenceSpec(int(request["steps"]), 1)]

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> TimedLoop:
        return TimedLoop(plugin_args, ctx)


def _inline(plugin: Any) -> Engine:
    return Engine(EngineArgs(plugin=plugin, config=EngineConfig(device=DeviceConfig(target="cpu"))),
                  DeploymentConfig(mode="inline"))


def test_the_forward_a_plugin_reports_is_apart_from_its_other_work_and_the_loops():
    with _inline(TimedLoopEntry) as engine:
        engine.step({"steps": 6})
        stats = engine.batch_stats()[0]
    parts, forward, host = stats["iteration_parts_ms"], stats["iteration_forward_ms"], stats["iteration_host_ms"]
    assert stats["iterations"] == 6
    assert FORWARD_S * 1e3 <= forward["p50"] < (FORWARD_S + HOST_S) * 1e3  # the reported forward only
    assert parts["rank_host"] >= HOST_S * 1e3  # the sleep outside the forward is the rank's host work
    assert host["p50"] >= parts["rank_host"] and 0 < stats["iteration_host_share"] < 1
    assert stats["iteration_forward_seconds"]["count"] == stats["iteration_host_seconds"]["count"] == 6


def test_without_a_reported_forward_the_whole_iterate_is_the_forward():
    with _inline(IterProbeEntry) as engine:
        engine.step({"prompts": [[1, 2]], "max_tokens": 4, "sleep": FORWARD_S})
        stats = engine.batch_stats()[0]
    assert stats["iteration_forward_ms"]["p50"] >= FORWARD_S * 1e3
    assert stats["iteration_parts_ms"]["rank_host"] == 0.0
    assert stats["iteration_host_ms"]["p50"] < stats["iteration_forward_ms"]["p50"]


def test_an_idle_replica_reports_no_iteration_yet():
    snap = IterationTimes().snapshot()
    assert snap["iteration_host_ms"] is None and snap["iteration_forward_seconds"]["count"] == 0


def test_parts_add_up_and_transport_is_the_round_trip_less_the_ranks_part():
    times = IterationTimes()
    times.record(0.001, 0.010, RankTiming(plan_s=0.002, iterate_s=0.006, forward_s=0.004))
    snap = times.snapshot()
    assert snap["iteration_parts_ms"] == {"loop": 1.0, "transport": 2.0, "rank_plan": 2.0, "rank_host": 2.0,
                                          "forward": 4.0}
    assert snap["iteration_host_ms"]["p50"] == pytest.approx(7.0) and snap["iteration_forward_ms"]["p50"] == 4.0


def test_the_edge_exports_both_histograms_of_a_continuous_batching_replica():
    times = IterationTimes()
    for _ in range(3):
        times.record(0.0001, 0.002, RankTiming(0.0, 0.0015, 0.001))
    stats = [{"replica": 0, "max_batch_size": 8, "batch_size": {"buckets": [(1, 1), (float("inf"), 1)], "sum": 1},
              "queue_wait_seconds": {"buckets": [(0.1, 1), (float("inf"), 1)], "sum": 0.05}, **times.snapshot()}]
    families = {f.name: f for f in _BatchCollector(lambda: "g0", lambda: stats).collect()}
    host = families["phyai_replica_iteration_host_seconds"].samples
    forward = families["phyai_replica_iteration_forward_seconds"].samples
    assert [s.value for s in host if s.name.endswith("_count")] == [3.0]
    assert [s.value for s in forward if s.name.endswith("_sum")] == [pytest.approx(0.003)]
