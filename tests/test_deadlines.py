"""A request's own deadline: earliest-deadline-first order, and a request whose deadline passes before
it starts answered without running. Without Ray: pure queue tables, the real scheduler with a
recording launcher, and inline engines (step queue and iteration loop).

Run: `.venv/bin/pytest tests/test_deadlines.py -q`

`Item` is a stand-in for a queued request (named as such: only `enqueue` and `form_batch` read it),
its times given by the test (a fake clock).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import wait
from dataclasses import dataclass

import pytest

from phyai_ray import BatchingConfig, DeadlineMissedError, DeploymentConfig, Engine, EngineArgs
from phyai_ray.errors import RequestTimeoutError
from phyai_ray.executors.batching import BatchPolicy, form_batch
from phyai_ray.executors.ledger import enqueue
from tests.test_batch_formation import Recorder, Scheduling


@dataclass(eq=False)
class Item:
    """A stand-in queued request: its own `deadline` (None: none), else submitted + limit_s."""

    name: str
    submitted: float
    deadline: float | None = None
    key: str = "a"
    size: int = 1
    weight: int = 0
    limit_s: float = 60.0

    @property
    def order(self) -> float:
        return self.deadline if self.deadline is not None else self.submitted + self.limit_s


def queued(items: list[Item], edf: bool) -> list[str]:
    q: deque = deque()
    for item in items:
        enqueue(q, item, edf)
    return [i.name for i in q]


ARRIVALS = [Item("bulk1", 0.0), Item("bulk2", 0.1), Item("robot1", 0.2, deadline=0.3), Item("bulk3", 0.3),
            Item("robot2", 0.4, deadline=0.45), Item("loose", 0.5, deadline=100.0), Item("robot3", 0.6, deadline=0.9)]


def test_deadline_order_is_earliest_deadline_first_and_fifo_is_arrival_order():
    assert queued(ARRIVALS, edf=True) == ["robot1", "robot2", "robot3", "bulk1", "bulk2", "bulk3", "loose"]
    assert queued(ARRIVALS, edf=False) == [i.name for i in ARRIVALS]


def test_without_deadlines_both_orders_are_arrival_order():
    items = [Item(f"r{i}", i * 0.01) for i in range(20)]
    assert queued(items, edf=True) == queued(items, edf=False) == [i.name for i in items]


def test_equal_deadlines_keep_arrival_order():
    items = [Item("a", 0.0, deadline=5.0), Item("b", 0.1, deadline=5.0), Item("c", 0.2, deadline=1.0), Item("d", 0.3, deadline=5.0)]
    assert queued(items, edf=True) == ["c", "a", "b", "d"]


def test_a_batch_forms_around_the_earliest_deadline():
    q: deque = deque()
    for item in ARRIVALS:
        enqueue(q, item, True)
    formed = form_batch(q, BatchPolicy(max_size=3), now=0.7, live=lambda i: True)
    assert [i.name for i in formed.batch] == ["robot1", "robot2", "robot3"]


def recording_scheduler(edf: bool, max_size: int | None = None):
    rec = Recorder()
    sched = Scheduling(rec.launch, max_ongoing=1, max_queued=100)
    sched.queue.edf = edf
    if max_size is not None:
        sched.queue.policy = BatchPolicy(max_size=max_size)
    rec.scheduler = sched
    return sched, rec


@pytest.mark.parametrize("edf,expected", [(True, ["tight", "medium", "none1", "none2"]),
                                          (False, ["none1", "medium", "tight", "none2"])])
def test_the_scheduler_dispatches_in_deadline_or_arrival_order(edf, expected):
    sched, rec = recording_scheduler(edf)
    now = time.monotonic()
    blocker = sched.submit("step", "running", 30.0)
    futures = [sched.submit("step", "none1", 30.0), sched.submit("step", "medium", 30.0, deadline=now + 20),
               sched.submit("step", "tight", 30.0, deadline=now + 10), sched.submit("step", "none2", 30.0)]
    order = []
    for _ in range(5):
        order.append(rec.launched[0].payload)
        rec.finish()
    assert order == ["running", *expected]
    assert blocker.result(timeout=1) == "running" and [f.result(timeout=1) for f in futures]


@pytest.mark.parametrize("max_size", [None, 8])
def test_a_request_whose_deadline_passes_in_the_queue_is_answered_at_once_and_never_launched(max_size):
    sched, rec = recording_scheduler(True, max_size)
    blocker = sched.submit("step", "running", 30.0)
    late = sched.submit("step", "late", 30.0, deadline=time.monotonic() + 0.1)
    kept = sched.submit("step", "kept", 30.0)
    with pytest.raises(DeadlineMissedError, match="was not run") as caught:
        late.result(timeout=2)  # the clock wakes for it: long before its execution limit
    assert isinstance(caught.value, RequestTimeoutError) and caught.value.deadline_s == pytest.approx(0.1, abs=0.01)
    assert late.finished - late.deadline < 1.0  # noticed soon after the deadline, not at the 5 s idle tick
    assert late.timing()["deadline_met"] is False and late.timing()["infer_ms"] is None
    rec.finish()
    rec.finish()
    launched = [blocker.result(timeout=1), kept.result(timeout=1)]
    assert launched == ["running", ["kept"] if max_size else "kept"] or launched == ["running", "kept"]
    assert sched.tally.missed == 1 and sched.tally.errored == 1 and sched.tally.served == 2
    assert not rec.launched


def test_a_dispatched_request_past_its_deadline_still_runs_and_says_it_was_late():
    sched, rec = recording_scheduler(True)
    future = sched.submit("step", "slow", 30.0, deadline=time.monotonic() + 0.05)
    time.sleep(0.1)  # the step runs past the deadline (it started in time)
    rec.finish()
    assert future.result(timeout=1) == "slow"
    timing = future.timing()
    assert timing["deadline_met"] is False and timing["infer_ms"] >= 50 and timing["deadline_ms"] == pytest.approx(50, abs=5)


# -- inline engines ----------------------------------------------------------------------------------

def test_engine_submit_checks_deadline_s():
    with Engine(EngineArgs(plugin="reference_policy")) as engine:
        for bad in (0, -1.0, "soon", float("nan"), True):
            with pytest.raises(ValueError, match="deadline_s"):
                engine.submit({"state": [0.0] * 8}, deadline_s=bad)
        future = engine.submit({"state": [0.0] * 8}, deadline_s=30.0)
        assert future.result(timeout=30)["actions"].shape == (10, 7)
        timing = future.timing()
        assert timing["deadline_met"] is True and timing["deadline_ms"] == pytest.approx(30_000, abs=1)
        assert timing["batch_size"] >= 1 and timing["queue_ms"] >= 0 and timing["infer_ms"] > 0


@pytest.mark.parametrize("scheduling", ["deadline", "fifo"])
def test_the_iteration_loop_admits_earliest_deadline_first(scheduling):
    """One sequence slot (max_num_seqs=1), three frames queued behind a frozen one: the slot goes to
    the earliest deadline ('deadline') or the earliest arrival ('fifo')."""
    deployment = DeploymentConfig(batching=BatchingConfig(max_num_seqs=1, scheduling=scheduling,
                                                          default_deadline_s=None))  # "none" sorts by its timeout
    with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args={"num_steps": 3}), deployment) as engine:
        frame = {"state": [0.1] * 8}
        first = engine.submit(frame)
        first.result(timeout=30)
        engine.pause(mode="keep")
        futures = {"none": engine.submit(frame), "loose": engine.submit(frame, deadline_s=50.0),
                   "tight": engine.submit(frame, deadline_s=20.0)}
        engine.resume()
        wait(list(futures.values()), timeout=30)
        order = sorted(futures, key=lambda name: futures[name].timing()["queue_ms"])
        assert order == (["tight", "loose", "none"] if scheduling == "deadline" else ["none", "loose", "tight"])
        assert all(f.timing()["batch_size"] == 1 for f in futures.values())


def test_a_frame_whose_deadline_passes_while_waiting_for_a_slot_is_answered_without_running():
    deployment = DeploymentConfig(batching=BatchingConfig(max_num_seqs=1))
    with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args={"num_steps": 3}), deployment) as engine:
        engine.submit({"state": [0.0] * 8}).result(timeout=30)
        engine.pause(mode="keep")
        late = engine.submit({"state": [0.0] * 8}, deadline_s=0.1)
        with pytest.raises(DeadlineMissedError):
            late.result(timeout=5)
        assert late.finished - late.deadline < 1.5  # the loop woke for it (its tick is 1 s)
        engine.resume()
        status = engine.replica_status()[0]
        assert status.errored == 1 and engine.batch_stats()[0]["waiting_sequences"] == 0
        assert engine.step({"state": [0.0] * 8})["actions"].shape == (16, 7)  # the replica serves on


def test_many_robots_with_deadlines_beside_bulk_requests_keep_their_order_under_load():
    """A deep queue (400 bulk requests) and 20 tight frames submitted after it: every tight frame runs
    before the bulk requests queued ahead of it (deadline scheduling), none is lost."""
    deployment = DeploymentConfig(batching=BatchingConfig(max_batch_size=8))
    with Engine(EngineArgs(plugin="reference_policy"), deployment) as engine:
        engine.pause(mode="keep")
        bulk = [engine.submit({"state": [float(i % 5)] * 8}) for i in range(400)]
        tight = [engine.submit({"state": [1.0] * 8}, deadline_s=5.0) for _ in range(20)]  # before default_deadline_s
        engine.resume()
        wait(bulk + tight, timeout=60)
        assert all(f.exception() is None for f in bulk + tight)
        last_tight = max(f.started for f in tight)
        assert sum(f.started < last_tight for f in bulk) < 8  # at most the batch that was forming


def test_deadline_errors_from_threads_do_not_disturb_the_others():
    """Submitters on 8 threads, half with deadlines already too short for the queue: every request ends
    (served or DeadlineMissedError), the counts add up, and the replica keeps serving."""
    with Engine(EngineArgs(plugin="reference_policy"), DeploymentConfig(batching=BatchingConfig(max_batch_size=4))) as engine:
        engine.pause(mode="keep")
        out: list = []
        lock = threading.Lock()

        def submit(n: int) -> None:
            mine = [engine.submit({"state": [0.0] * 8}, deadline_s=0.05 if n % 2 else None) for _ in range(50)]
            with lock:
                out.extend(mine)
        threads = [threading.Thread(target=submit, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        time.sleep(0.2)
        engine.resume()
        wait(out, timeout=60)
        missed = [f for f in out if isinstance(f.exception(), DeadlineMissedError)]
        served = [f for f in out if f.exception() is None]
        assert len(missed) == 200 and len(served) == 200
        status = engine.replica_status()[0]
        assert status.served == 200 and status.errored == 200 and status.in_flight == 0
