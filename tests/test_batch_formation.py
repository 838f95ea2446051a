"""Batch formation and the batching scheduler, without Ray: pure tables and a recording launcher.

Run: `.venv/bin/pytest tests/test_batch_formation.py -q`

`Item` is a stand-in for a queued request (named as such: only `form_batch` reads it); the
scheduler tests use the real `StepQueue` and `RankPipeline` with a launcher that records what it was given.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from types import SimpleNamespace

import pytest

from phyai_ray.errors import RequestTimeoutError
from phyai_ray.executors.batching import BatchPolicy, Histogram, form_batch
from phyai_ray.executors.futures import CallbackThread
from phyai_ray.executors.clock import _CLOCK_TICK_S, DeadlineClock
from phyai_ray.executors.ledger import Counts
from phyai_ray.executors.pipeline import RankPipeline
from phyai_ray.executors.queues import StepQueue


@dataclass(eq=False)
class Item:
    """A stand-in queued request: what form_batch reads."""

    name: str
    key: str = "a"
    size: int = 1
    weight: int = 0
    submitted: float = 0.0
    limit_s: float = 60.0
    alive: bool = True
    deadline: float | None = None


def names(items) -> list[str]:
    return [i.name for i in items]


def queue(spec: str, **kw) -> deque:
    """'a1 a2 b1' -> items named a1, a2, b1 with keys a, a, b."""
    return deque(Item(n, key=n[0], **kw) for n in spec.split())


def live(item: Item) -> bool:
    return item.alive


def test_the_head_leads_same_key_requests_join_in_order_and_others_keep_their_place():
    q = queue("a1 a2 b1 a3 b2 a4")
    formed = form_batch(q, BatchPolicy(max_size=3), now=0.0, live=live)
    assert names(formed.batch) == ["a1", "a2", "a3"] and formed.wait_until is None
    assert names(q) == ["b1", "b2", "a4"]
    assert names(form_batch(q, BatchPolicy(max_size=3), 0.0, live).batch) == ["b1", "b2"]
    assert names(q) == ["a4"]


@pytest.mark.parametrize("sizes, batch, left", [
    ([2, 2, 1, 3], ["r0", "r1", "r2"], ["r3"]),  # 2 + 2 + 1 = 5 fills it; r3 waits
    ([4, 3, 1], ["r0", "r2"], ["r1"]),  # r1 does not fit (4 + 3 > 5) and is passed over, not dropped
    ([9, 1], ["r0"], ["r1"]),  # a request larger than max_size runs alone
])
def test_samples_never_pass_max_size(sizes, batch, left):
    q = deque(Item(f"r{i}", size=s) for i, s in enumerate(sizes))
    formed = form_batch(q, BatchPolicy(max_size=5), 0.0, live)
    assert names(formed.batch) == batch and names(q) == left


def test_expired_or_cancelled_requests_never_join_and_leave_the_queue():
    q = queue("a1 a2 a3 a4")
    q[0].alive = q[2].alive = False
    formed = form_batch(q, BatchPolicy(max_size=8), 0.0, live)
    assert names(formed.batch) == ["a2", "a4"] and names(formed.dead) == ["a1", "a3"] and not q


def test_a_delay_holds_a_short_batch_until_full_or_its_flush_time():
    policy = BatchPolicy(max_size=4, max_delay_s=0.010)
    q = queue("a1 a2", submitted=100.0)
    formed = form_batch(q, policy, now=100.004, live=live)
    assert formed.batch == [] and formed.wait_until == pytest.approx(100.010) and names(q) == ["a1", "a2"]
    assert names(form_batch(q, policy, now=100.010, live=live).batch) == ["a1", "a2"]
    q = queue("a1 a2 a3 a4", submitted=100.0)
    assert names(form_batch(q, policy, now=100.001, live=live).batch) == ["a1", "a2", "a3", "a4"]  # full: now


def test_the_delay_never_passes_half_the_requests_time_limit():
    q = queue("a1", submitted=0.0, limit_s=0.004)
    formed = form_batch(q, BatchPolicy(max_size=4, max_delay_s=1.0), now=0.0, live=live)
    assert formed.wait_until == pytest.approx(0.002)


def test_a_preferred_size_cuts_the_batch_and_dispatches_without_waiting():
    policy = BatchPolicy(max_size=8, max_delay_s=1.0, preferred=(2, 4))
    q = queue("a1 a2 a3 a4 a5 a6")
    assert names(form_batch(q, policy, 0.0, live).batch) == ["a1", "a2", "a3", "a4"]
    assert names(form_batch(q, policy, 0.0, live).batch) == ["a5", "a6"]


def test_max_weight_bounds_what_one_message_carries():
    q = deque(Item(f"r{i}", weight=100) for i in range(4))
    assert names(form_batch(q, BatchPolicy(max_size=8, max_weight=250), 0.0, live).batch) == ["r0", "r1"]


def test_histogram_is_cumulative_with_an_inf_bucket():
    h = Histogram((1, 4))
    for v in (1, 2, 3, 9):
        h.observe(v)
    assert h.snapshot() == {"buckets": [(1, 1), (4, 3), (float("inf"), 4)], "sum": 15.0, "count": 4}


# -- the scheduler with batching on, fed by a recording launcher -----------------------------------
class Scheduling:
    """The parts that schedule a replica's steps, wired as `ScheduledReplica` wires them: a `StepQueue`
    feeding a `RankPipeline` whose executor only records `launch`, one `DeadlineClock`."""

    def __init__(self, launch, *, max_ongoing: int | None, max_queued: int | None, on_hung=lambda w, s: None,
                 hang_limit_s: float = 600.0):
        lock = threading.RLock()
        self.clock = DeadlineClock(0, lock)
        self.pipeline = RankPipeline(0, SimpleNamespace(launch=launch), max_ongoing=max_ongoing, lock=lock,
                                     clock=self.clock, on_hung=on_hung, delivery=CallbackThread("test-callbacks"),
                                     limit_s=hang_limit_s)
        self.queue = StepQueue(0, self.pipeline, None, lock=lock, clock=self.clock, limit_s=30.0, max_queued=max_queued)
        self.deliver, self.finished, self.tally = self.pipeline.deliver, self.pipeline.finished, self.pipeline.tally
        self.service = self.pipeline.service

    def submit(self, kind, payload, limit_s, **kwargs):
        return self.queue.put(kind, payload, limit_s, **kwargs)

    def counts(self) -> Counts:
        queued, at_ranks = self.queue.counts(), self.pipeline.counts()
        return Counts(queued.queued, at_ranks.dispatched, at_ranks.served, at_ranks.errored)

    def stop(self, refusal, cancel_queued: bool = True) -> None:
        self.queue.stop(refusal, cancel_waiting=cancel_queued)
        self.pipeline.stop(refusal)
        self.clock.stop()


class Recorder:
    """Records launched work; `finish()` answers the oldest launched batch with one result per member."""

    def __init__(self) -> None:
        self.launched: list = []
        self.scheduler: Scheduling | None = None

    def launch(self, work) -> None:
        self.launched.append(work)

    def finish(self, values=None) -> None:
        work = self.launched.pop(0)
        if values is not None:
            out = values
        else:
            out = [m.payload for m in work.members] if work.kind == "batch" else work.payload
        self.scheduler.deliver(work, out)
        self.scheduler.finished(work)


def batching_scheduler(max_size: int | None = 4, delay_s: float = 0.0, max_ongoing: int = 1, max_queued: int = 100):
    """A scheduler fed by a Recorder; `max_size=None`: batching off."""
    rec = Recorder()
    sched = Scheduling(rec.launch, max_ongoing=max_ongoing, max_queued=max_queued)
    if max_size is not None:
        sched.queue.policy = BatchPolicy(max_size=max_size, max_delay_s=delay_s)
    rec.scheduler = sched
    return sched, rec


def test_queued_requests_form_batches_while_one_runs_and_accounting_stays_exact():
    sched, rec = batching_scheduler(max_size=4)
    futures = [sched.submit("step", f"p{i}", 30.0, key=i % 2) for i in range(7)]
    assert [w.kind for w in rec.launched] == ["batch"] and rec.launched[0].payload == ["p0"]
    assert sched.counts().queued == 6 and sched.counts().dispatched == 1
    rec.finish()
    assert rec.launched[0].payload == ["p1", "p3", "p5"]  # the head (key 1) leads; key 0 waits its turn
    rec.finish()
    assert rec.launched[0].payload == ["p2", "p4", "p6"]
    rec.finish()
    assert [f.result(timeout=1) for f in futures] == [f"p{i}" for i in range(7)]
    counts = sched.counts()
    assert (counts.queued, counts.dispatched, counts.served, counts.errored) == (0, 0, 7, 0)


def test_an_exception_item_fails_only_its_request():
    sched, rec = batching_scheduler(max_size=4)
    first = sched.submit("step", "x", 30.0)
    futures = [sched.submit("step", i, 30.0) for i in range(3)]
    rec.finish()
    rec.finish([0, ValueError("bad item"), 2])
    assert first.result(timeout=1) == "x" and futures[0].result(timeout=1) == 0 and futures[2].result(timeout=1) == 2
    with pytest.raises(ValueError, match="bad item"):
        futures[1].result(timeout=1)
    assert (sched.counts().served, sched.counts().errored) == (3, 1)


def test_a_short_step_batch_list_fails_each_request_of_the_batch_once_on_the_rank():
    """The one check of what step_batch returned is the rank's (RankRunner.execute, every executor's path)."""
    from phyai_ray.config.engine import DeviceConfig
    from phyai_ray.config.parallel import ParallelConfig
    from phyai_ray.executors.inline import build_inline_runner
    from phyai_ray.work import Kind
    from tests.plugins.batching import BatchProbeEntry

    runner = build_inline_runner(BatchProbeEntry(), {}, ParallelConfig(), DeviceConfig(target="cpu"))
    runner.model.step_batch = lambda requests: [1]  # one result for two requests
    out = runner.execute(Kind.BATCH, [{"x": 1}, {"x": 2}])
    assert len(out) == 2 and all(isinstance(e, TypeError) and "one result" in str(e) for e in out)


def test_cancelled_and_expired_requests_never_reach_the_launcher():
    sched, rec = batching_scheduler(max_size=8)
    blocker = sched.submit("step", "running", 30.0)
    cancelled = sched.submit("step", "cancelled", 30.0)
    short = sched.submit("step", "expires", 0.05)
    kept = sched.submit("step", "kept", 30.0)
    assert cancelled.cancel()
    with pytest.raises(RequestTimeoutError, match="never reached a rank"):
        short.result(timeout=5)
    rec.finish()
    assert rec.launched[0].payload == ["kept"]
    rec.finish()
    assert blocker.result(timeout=1) == "running" and kept.result(timeout=1) == "kept"



@pytest.mark.parametrize("max_size", [None, 8])
def test_a_short_limit_queued_behind_a_long_one_expires_at_its_own_deadline(max_size):
    """The clock wakes for the earliest deadline of the whole queue, not only the head's."""
    sched, rec = batching_scheduler(max_size=max_size)
    blocker = sched.submit("step", "running", 30.0)
    patient = sched.submit("step", "patient", 30.0)
    short = sched.submit("step", "expires", 0.2)
    with pytest.raises(RequestTimeoutError, match="never reached a rank"):
        short.result(timeout=_CLOCK_TICK_S / 2)  # the clock's idle tick would be too late
    assert time.monotonic() - short.work.expires < _CLOCK_TICK_S / 2
    assert sched.counts().queued == 1 and not patient.done()
    rec.finish()
    rec.finish()
    assert blocker.result(timeout=1) == "running" and patient.result(timeout=1) == "patient"

def test_the_clock_dispatches_a_waiting_head_after_max_batch_delay():
    sched, rec = batching_scheduler(max_size=8, delay_s=0.2)
    arrived = time.monotonic()
    future = sched.submit("step", "alone", 30.0)
    assert rec.launched == []

    def answer() -> None:
        while not rec.launched:
            time.sleep(0.001)
        rec.finish()
    helper = threading.Thread(target=answer, daemon=True)
    helper.start()
    assert future.result(timeout=5) == "alone"
    waited = time.monotonic() - arrived
    assert 0.2 <= waited < 1.0, f"dispatched {waited:.3f}s after arrival with max_batch_delay 0.2s"
    helper.join(timeout=5)


def test_a_slow_launch_holds_no_lock_that_submit_or_counts_need():
    """launch() sends to every rank (N actor calls, a copy of a large body): never under the scheduler's lock."""
    entered, release = threading.Event(), threading.Event()
    launched = []

    def slow_launch(work) -> None:
        entered.set()
        release.wait(5)
        launched.append(work.payload)
    sched = Scheduling(slow_launch, max_ongoing=2, max_queued=100)
    first = threading.Thread(target=sched.submit, args=("step", "a", 30.0))
    first.start()
    assert entered.wait(5)
    started = time.monotonic()
    counts = sched.counts()
    second = sched.submit("step", "b", 30.0)  # dispatched too (max_ongoing 2); its launch is left to the sender
    assert time.monotonic() - started < 0.5 and counts.dispatched == 1
    release.set()
    first.join(5)
    deadline = time.monotonic() + 5
    while len(launched) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert launched == ["a", "b"] and not second.done()  # in dispatch order, by the thread that was sending
    sched.stop(lambda: RuntimeError("the test is over"), cancel_queued=True)


def test_a_head_reported_hung_is_reported_once_and_the_clock_then_sleeps():
    """An on_hung that does not stop the replica (a test's) must not make the clock spin on the same head."""
    reports = []
    rec = Recorder()
    sched = Scheduling(rec.launch, max_ongoing=1, max_queued=100, on_hung=lambda work, s: reports.append(work.payload),
                       hang_limit_s=0.2)  # the replica's hang limit: one rank call running this long is hung
    rec.scheduler = sched
    stuck = sched.submit("step", "stuck", 0.2)
    with pytest.raises(RequestTimeoutError):
        stuck.result(timeout=5)
    deadline = time.monotonic() + 5
    while not reports and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.process_time()
    time.sleep(1.0)
    assert reports == ["stuck"], reports  # once, not once per clock turn
    assert time.process_time() - started < 0.5, "the clock thread spun on a head it had already reported"
    sched.stop(lambda: RuntimeError("the test is over"), cancel_queued=True)
