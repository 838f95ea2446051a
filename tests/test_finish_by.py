"""Deadlines that mean what robots need: the batch delay capped by a member's deadline, finish-by
admission from the replica's recent step time, late results dropped with late="drop", and a
default deadline that keeps no-deadline requests from starving. Without Ray: pure batch tables
with a fake clock, the real scheduler with a recording launcher, and inline engines.

Run: `.venv/bin/pytest tests/test_finish_by.py -q`
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import pytest

from phyai_ray import BatchingConfig, DeadlineMissedError, DeploymentConfig, Engine, EngineArgs
from phyai_ray.executors.batching import BatchPolicy, flush_margin, form_batch
from phyai_ray.executors.service import ServiceTime
from tests.test_batch_formation import batching_scheduler


@dataclass(eq=False)
class Item:
    """A stand-in queued request (what form_batch reads), its times from a fake clock."""

    name: str
    submitted: float = 0.0
    deadline: float | None = None
    key: str = "a"
    size: int = 1
    weight: int = 0
    limit_s: float = 60.0


def wait_launched(rec, timeout_s: float = 2.0) -> bool:
    """Whether the recorder got a launch within `timeout_s` (the scheduler's clock thread sends it)."""
    end = time.monotonic() + timeout_s
    while not rec.launched and time.monotonic() < end:
        time.sleep(0.002)
    return bool(rec.launched)


# -- the batch delay: capped by the earliest member's deadline minus the step time -----------------

def test_the_batch_delay_ends_before_a_member_would_miss_its_deadline():
    policy = BatchPolicy(max_size=8, max_delay_s=1.0)
    q = deque([Item("loose", 0.0), Item("robot", 0.0, deadline=0.9)])
    formed = form_batch(q, policy, now=0.1, live=lambda i: True, service_s=0.6)
    assert formed.batch == [] and formed.wait_until == pytest.approx(0.3 - flush_margin(0.6))  # was 1.0: too late
    formed = form_batch(q, policy, now=0.31, live=lambda i: True, service_s=0.6)
    assert [i.name for i in formed.batch] == ["loose", "robot"]
    q = deque([Item("robot", 0.0, deadline=0.9)])  # no step timed yet: at most half its way to the deadline
    assert form_batch(q, policy, now=0.1, live=lambda i: True).wait_until == pytest.approx(0.45)


def test_without_deadlines_the_batch_delay_is_unchanged():
    formed = form_batch(deque([Item("a1"), Item("a2")]), BatchPolicy(max_size=8, max_delay_s=0.2), 0.0,
                        lambda i: True, service_s=0.05)
    assert formed.wait_until == pytest.approx(0.2)


def test_an_idle_replica_with_a_long_batch_delay_still_meets_a_deadline():
    sched, rec = batching_scheduler(max_size=8, delay_s=5.0)
    future = sched.submit("step", "robot", 30.0, deadline=time.monotonic() + 0.2)
    assert wait_launched(rec, 1.0), "the lone request waited out the 5 s batch delay"
    rec.finish()
    assert future.result(timeout=1) == "robot" and future.timing()["deadline_met"] is True


# -- finish-by admission ---------------------------------------------------------------------------

def test_service_time_is_the_recent_median():
    service = ServiceTime(window=3)
    assert service.estimate() == 0.0
    for seconds in (0.1, 5.0, 0.2, 0.3):  # 0.1 leaves the window; 5.0 is an outlier the median ignores
        service.record(seconds)
    assert service.estimate() == pytest.approx(0.3)
    with pytest.raises(ValueError, match="window=0"):
        ServiceTime(window=0)


def test_the_scheduler_records_how_long_its_steps_take():
    sched, rec = batching_scheduler(max_size=None)
    sched.submit("step", "a", 30.0)
    time.sleep(0.05)
    rec.finish()
    assert 0.04 <= sched.service.estimate() < 1.0


@pytest.mark.parametrize("max_size", [None, 8])
def test_a_request_that_cannot_finish_by_its_deadline_is_answered_at_once(max_size):
    sched, rec = batching_scheduler(max_size=max_size)
    for _ in range(5):
        sched.service.record(0.2)
    hopeless = sched.submit("step", "hopeless", 30.0, deadline=time.monotonic() + 0.05)
    with pytest.raises(DeadlineMissedError, match="step takes about 200.0 ms"):
        hopeless.result(timeout=0.01)  # answered in submit, without waiting for the clock
    fine = sched.submit("step", "fine", 30.0, deadline=time.monotonic() + 2.0)
    assert wait_launched(rec)
    rec.finish()
    assert fine.result(timeout=1) in ("fine", ["fine"])
    assert sched.tally.missed == 1 and sched.tally.served == 1 and not rec.launched


def test_a_queued_request_that_can_no_longer_finish_in_time_never_starts():
    sched, rec = batching_scheduler(max_size=None)
    for _ in range(5):
        sched.service.record(0.2)
    blocker = sched.submit("step", "running", 30.0)
    queued = sched.submit("step", "queued", 30.0, deadline=time.monotonic() + 0.35)
    time.sleep(0.2)  # now 0.15 s are left: less than a step
    rec.finish()
    assert blocker.result(timeout=1) == "running"
    with pytest.raises(DeadlineMissedError, match="could not be met"):
        queued.result(timeout=1)
    assert not rec.launched  # start-by admission would have started it, to finish late


# -- late results ----------------------------------------------------------------------------------

@pytest.mark.parametrize("max_size", [None, 8])
def test_late_drop_answers_a_result_ready_after_the_deadline_as_missed(max_size):
    sched, rec = batching_scheduler(max_size=max_size)
    future = sched.submit("step", "stale", 30.0, deadline=time.monotonic() + 0.05, late="drop")
    assert wait_launched(rec)
    time.sleep(0.1)  # the step ends after the deadline
    rec.finish()
    with pytest.raises(DeadlineMissedError, match="late result was dropped"):
        future.result(timeout=1)
    assert future.timing()["deadline_met"] is False


def test_late_drop_delivers_a_result_ready_in_time():
    sched, rec = batching_scheduler(max_size=None)
    future = sched.submit("step", "fresh", 30.0, deadline=time.monotonic() + 5.0, late="drop")
    rec.finish()
    assert future.result(timeout=1) == "fresh"


def test_engine_takes_late_per_request_and_from_batching_config():
    with Engine(EngineArgs(plugin="reference_policy")) as engine:
        with pytest.raises(ValueError, match="late='soon' must be 'finish'"):
            engine.submit({"state": [0.0] * 8}, deadline_s=1.0, late="soon")
        assert engine.step({"state": [0.0] * 8}, deadline_s=30.0, late="drop")["actions"].shape == (10, 7)
    with pytest.raises(ValueError):
        BatchingConfig(late="sometimes")
    deployment = DeploymentConfig(batching=BatchingConfig(late="drop"))
    with Engine(EngineArgs(plugin="reference_policy"), deployment) as engine:
        assert engine._late(None) == "drop" and engine._late("finish") == "finish"


# -- no starvation ---------------------------------------------------------------------------------

def test_a_request_without_deadline_is_due_default_deadline_s_after_arrival():
    sched, rec = batching_scheduler(max_size=None)
    sched.queue.edf, sched.queue.default_deadline_s = True, 1.0
    now = time.monotonic()
    sched.submit("step", "running", 30.0)
    bulk = sched.submit("step", "bulk", 30.0)
    robots = [sched.submit("step", f"robot{i}", 30.0, deadline=now + 5.0) for i in range(3)]
    order = []
    for _ in range(5):
        order.append(rec.launched[0].payload)
        rec.finish()
    assert order == ["running", "bulk", "robot0", "robot1", "robot2"]  # bulk is due first (1 s < 5 s)
    assert bulk.result(timeout=1) == "bulk" and all(r.result(timeout=1) for r in robots)


def test_default_deadline_s_has_a_default_and_is_checked():
    assert BatchingConfig().default_deadline_s == 10.0 and BatchingConfig(default_deadline_s=None).default_deadline_s is None
    with pytest.raises(ValueError):
        BatchingConfig(default_deadline_s=0)


def test_the_knobs_are_command_line_flags():
    import argparse

    from phyai_ray.flags import add_config_flags, build_configs

    parser = argparse.ArgumentParser()
    parser.add_argument("--plugin", dest="args.plugin", default="reference_policy")
    add_config_flags(parser)
    _, deployment = build_configs(parser.parse_args(["--default-deadline-s", "2.5", "--late", "drop"]))
    assert deployment.batching.default_deadline_s == 2.5 and deployment.batching.late == "drop"


def test_the_iteration_loop_orders_a_no_deadline_request_by_default_deadline_s():
    from phyai_ray.executors.sequences import LoopRequest

    deployment = DeploymentConfig(batching=BatchingConfig(default_deadline_s=2.0))
    with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args={"num_steps": 3}), deployment) as engine:
        future = engine.submit({"state": [0.1] * 8})
        assert isinstance(future.work, LoopRequest)
        assert future.work.order == pytest.approx(future.work.submitted + 2.0)
        future.result(timeout=30)


def test_a_flow_frame_late_mid_way_is_dropped_at_the_next_iteration_with_late_drop():
    deployment = DeploymentConfig(batching=BatchingConfig(max_num_seqs=1))
    with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args={"num_steps": 40}), deployment) as engine:
        frame = {"state": [0.1] * 8}
        engine.step(frame)  # warm
        began = time.monotonic()
        took = time.monotonic() - began if engine.step(frame) is not None else 0.0
        engine._executors[0].queue.service = ServiceTime()  # no estimate: finish-by would refuse it at once
        late = engine.submit(frame, deadline_s=max(took / 4, 0.002), late="drop")
        after = engine.submit(frame)  # waits for the only slot
        with pytest.raises(DeadlineMissedError, match="late result was dropped"):
            late.result(timeout=30)
        assert late.finished - began - took < took * 0.9  # it left mid-way, not after all its steps
        assert after.result(timeout=30)["actions"].shape[0] > 0


def test_late_drop_is_decided_as_the_result_is_delivered_after_gather(monkeypatch):
    """A deadline that falls while the plugin's gather runs is missed: the late result is not sent."""
    with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args={"num_steps": 2})) as engine:
        frame = {"state": [0.1] * 8}
        engine.step(frame)  # warm
        loop = engine._executors[0].queue
        loop.service = ServiceTime()  # no estimate: admission lets the frame run
        gather = loop._entry.gather

        def slow_gather(request, outputs):
            time.sleep(0.3)
            return gather(request, outputs)

        monkeypatch.setattr(loop._entry, "gather", slow_gather)
        late = engine.submit(frame, deadline_s=0.15, late="drop")
        with pytest.raises(DeadlineMissedError, match="late result was dropped"):
            late.result(timeout=30)
        assert late.timing()["deadline_met"] is False
        fresh = engine.submit(frame, deadline_s=30.0, late="drop")
        assert fresh.result(timeout=30)["actions"].shape[0] > 0


def test_a_no_deadline_request_is_due_default_deadline_s_after_arrival_plus_its_own_work():
    deployment = DeploymentConfig(batching=BatchingConfig(default_deadline_s=2.0))
    with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args={"num_steps": 3}), deployment) as engine:
        engine.step({"state": [0.1] * 8})  # warm
        service = ServiceTime()
        for _ in range(4):
            service.record(0.1)
        engine._executors[0].queue.service = service
        future = engine.submit({"state": [0.1] * 8})
        # pushed back by its 3 steps: a long job never sorts ahead of a deadline it could delay (turns.py)
        assert future.work.order == pytest.approx(future.work.submitted + 2.0 + 3 * 0.1)
        future.result(timeout=30)
