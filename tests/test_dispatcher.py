"""Routing and the per-replica scheduler, driven by hypothesis over hand-run replicas.

`ManualExecutor` is a real `ScheduledReplica` (real queue, pipeline, limits and accounting) whose
"ranks" are this test (`ManualRanks`): `launch` only records the dispatched work, and the test finishes it. A
stateful hypothesis machine submits, finishes, cancels, expires and fails requests and flips
health; after every step each replica's counts must match its futures (queued = PENDING,
dispatched = RUNNING), the ranks must never hold more than `max_ongoing`, and each choice must be
the healthy replica with room and the fewest in flight, ties to the least recently chosen.

Run: .venv/bin/pytest tests/test_dispatcher.py -q
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from phyai_ray.dispatcher import RequestDispatcher
from phyai_ray.errors import (EngineOverloadedError, EngineUnavailableError, ReplicaStateError, RequestAbortedError,
                              RequestTimeoutError)
from phyai_ray.executors.base import ScheduledReplica


class ManualRanks:
    """An `Executor` run by hand: dispatched work waits in `at_ranks` until the test finishes it."""

    name, world_size, batchable, iterative, max_batch_weight = "manual", 1, False, False, None
    runs_here = lockstep = False

    def __init__(self) -> None:
        self.at_ranks: list = []
        self.launched = 0
        self.peak = 0

    def bind(self, link) -> None:
        self.link = link

    def prepare(self, payload):
        return payload

    def weight(self, prepared) -> int:
        return 0

    def launch(self, work) -> None:
        self.at_ranks.append(work)
        self.launched += 1
        self.peak = max(self.peak, len(self.at_ranks))

    def control(self, op, args, timeout_s):
        future: Future = Future()
        future.set_result([(op, args)])
        return future

    def hang_detail(self, work):
        return 0, None, "rank(s) [0] had not replied"

    def abandon(self) -> None:
        self.at_ranks.clear()

    def close(self, drain: bool) -> None:
        self.at_ranks.clear()

    def nodes(self):
        return ()

    def pids(self):
        return (0,)


class ManualExecutor(ScheduledReplica):
    """A real `ScheduledReplica` (real queue, pipeline, limits and accounting) over `ManualRanks`."""

    def __init__(self, index: int, max_ongoing: int = 2, max_queued: int | None = 3) -> None:
        super().__init__(ManualRanks(), index=index, max_ongoing=max_ongoing, max_queued=max_queued,
                         step_limit_s=3600)

    @property
    def at_ranks(self) -> list:
        return self.ranks.at_ranks

    @property
    def launched(self) -> int:
        return self.ranks.launched

    @property
    def peak(self) -> int:
        return self.ranks.peak

    def finish_next(self, how: str) -> None:
        work = self.at_ranks.pop(0)
        if how == "result":
            self.pipeline.deliver(work, "ok")
        else:
            self.pipeline.deliver(work, error=ValueError("plugin rejected the payload"))
        self.pipeline.finished(work)


class _Fixed:
    """A `data` stand-in that always draws the given executor (for finishing on one replica)."""

    def __init__(self, executor: ManualExecutor) -> None:
        self.executor = executor

    def draw(self, strategy):
        return self.executor


def _states(executor: ManualExecutor, futures: list[Future]) -> tuple[int, int]:
    pending = sum(1 for f in futures if not f.done() and not f.running())
    running = sum(1 for f in futures if f.running())
    return pending, running


class DispatcherMachine(RuleBasedStateMachine):
    """Model: expected last-chosen ticks, served and errored counts per replica."""

    @initialize(n=st.integers(1, 3), ongoing=st.integers(1, 2), queued=st.integers(0, 3))
    def setup(self, n, ongoing, queued):
        self.executors = [ManualExecutor(i, ongoing, queued) for i in range(n)]
        self.dispatcher = RequestDispatcher(self.executors)
        self.futures: list[list[Future]] = [[] for _ in range(n)]
        self.last, self.tick = [-1] * n, 0
        self.served, self.errored = [0] * n, [0] * n

    def _in_flight(self, i: int) -> int:
        return sum(1 for f in self.futures[i] if not f.done())

    def _room(self, i: int) -> bool:
        e = self.executors[i]
        queued, _ = _states(e, self.futures[i])
        free_now = len(e.at_ranks) < e.pipeline.max_ongoing and e.serving and not queued
        return free_now or queued < e.max_queued

    @rule()
    def submit(self):
        healthy = [i for i, e in enumerate(self.executors) if e.healthy]
        open_ = [i for i in healthy if self._room(i)]
        if not open_:
            with pytest.raises(EngineOverloadedError if healthy else EngineUnavailableError):
                self.dispatcher.submit("x")
            return
        best = min(open_, key=lambda i: (not self.executors[i].serving, self._in_flight(i), self.last[i]))
        future = self.dispatcher.submit(("req", self.tick))
        assert future.work in self.executors[best].at_ranks or future.work in self.executors[best].queue._queued
        self.futures[best].append(future)
        self.last[best], self.tick = self.tick, self.tick + 1

    @precondition(lambda self: any(e.at_ranks for e in self.executors))
    @rule(data=st.data(), how=st.sampled_from(["result", "exception"]))
    def finish(self, data, how):
        e = data.draw(st.sampled_from([e for e in self.executors if e.at_ranks]))
        head = e.at_ranks[0]
        counted = not head.future.done()
        e.finish_next(how)
        if counted:
            (self.served if how == "result" else self.errored)[e.index] += 1

    @precondition(lambda self: any(not f.done() for fs in self.futures for f in fs))
    @rule(data=st.data())
    def cancel(self, data):
        index, future = data.draw(st.sampled_from([(i, f) for i, fs in enumerate(self.futures) for f in fs
                                                   if not f.done()]))
        was_queued = not future.running()
        assert future.cancel() == was_queued
        assert future.work not in self.executors[index].at_ranks or not was_queued  # nothing reached a rank

    @rule(data=st.data())
    def expire_queued(self, data):
        """Every queued request of one replica passes its deadline: each fails alone, none reaches a rank."""
        e = data.draw(st.sampled_from(self.executors))
        queued = [f for f in self.futures[e.index] if not f.done() and not f.running()]
        for f in queued:
            f.work.submitted -= 7200
        launched = e.launched
        e.queue.expire(time.monotonic())
        for f in queued:
            assert isinstance(f.exception(timeout=0), RequestTimeoutError)
        self.errored[e.index] += len(queued)
        assert e.launched == launched and e.healthy == (e.failure is None)

    @rule(data=st.data())
    def fail_group(self, data):
        e = data.draw(st.sampled_from(self.executors))
        if not e.healthy:
            return
        unfinished = [f for f in self.futures[e.index] if not f.done()]
        e.fail(EngineUnavailableError("rank 0 exited", reason="worker_exit", replica=e.index, rank=0))
        for f in unfinished:
            assert isinstance(f.exception(timeout=0), EngineUnavailableError)
        self.errored[e.index] += len(unfinished)

    @rule(data=st.data(), op=st.sampled_from(["pause", "resume", "sleep", "wake_up", "start_weight_update",
                                              "update_weights", "finish_weight_update"]),
          mode=st.sampled_from(["wait", "abort", "keep"]))
    def control(self, data, op, mode):
        """A control call: allowed ones move the state as the table says, illegal ones change nothing."""
        e = data.draw(st.sampled_from(self.executors))
        if not e.healthy:
            return
        while e.at_ranks and not (op == "pause" and mode == "keep"):
            self.finish(data=_Fixed(e), how="result")  # the ranks finish what they hold (drain)
        before = e.state.value
        allowed = {"pause": {"SERVING", "PAUSED"}, "resume": {"SERVING", "PAUSED"},
                   "sleep": {"SERVING", "PAUSED", "SLEEPING"}, "wake_up": {"SERVING", "PAUSED", "SLEEPING"},
                   "start_weight_update": {"SERVING", "PAUSED", "SLEEPING"}, "update_weights": {"UPDATING"},
                   "finish_weight_update": {"UPDATING"}}[op]
        args = {"sleep": (1,), "wake_up": (None,), "start_weight_update": (self.tick,),
                "update_weights": (("bucket",),),
                "finish_weight_update": (e.pending_version,)}.get(op, (mode,))
        if before not in allowed:
            with pytest.raises(ReplicaStateError, match=f"is {before}: {op}"):
                e.control(op, args, timeout_s=1, mode=mode)
            assert e.state.value == before
            return
        if op == "finish_weight_update" and not e.lifecycle._life.update.complete:  # no update_weights since the start
            with pytest.raises(ReplicaStateError, match=r"finish_weight_update\(\) refused"):
                e.control(op, args, timeout_s=1, mode=mode)
            assert e.state.value == before
            return
        queued = [f for f in self.futures[e.index] if not f.done() and not f.running()]
        report = e.control(op, args, timeout_s=1, mode=mode)
        if op == "pause" and mode == "abort":
            assert report.aborted == len(queued)
            assert all(isinstance(f.exception(timeout=0), RequestAbortedError) for f in queued)
            self.errored[e.index] += len(queued)
        assert report.state == e.state.value
        if op == "finish_weight_update":
            assert e.weight_version == args[0]

    @invariant()
    def only_serving_replicas_dispatch(self):
        for e in self.executors:  # a replica that is not SERVING keeps its queue: nothing moves to the ranks
            if e.healthy and e.state.value != "SERVING":
                assert e.pipeline.held
            elif e.healthy:
                assert not e.queue.counts().queued or len(e.at_ranks) == e.pipeline.max_ongoing

    @invariant()
    def counts_match_futures(self):
        for i, e in enumerate(self.executors):
            counts = self.dispatcher.counts(i)
            assert (counts.queued, counts.dispatched) == _states(e, self.futures[i])
            assert (counts.served, counts.errored) == (self.served[i], self.errored[i])
            assert e.peak <= e.pipeline.max_ongoing
            assert counts.queued <= e.max_queued


DispatcherMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestDispatcherMachine = DispatcherMachine.TestCase


# -- plain cases -----------------------------------------------------------------------------------

def test_least_in_flight_then_round_robin():
    executors = [ManualExecutor(i, max_queued=None) for i in range(3)]
    d = RequestDispatcher(executors)
    futures = [d.submit(k) for k in range(6)]
    assert [next(e.index for e in executors if f.work in e.at_ranks) for f in futures] == [0, 1, 2, 0, 1, 2]
    executors[0].finish_next("result")  # replica 0 now has the fewest in flight
    nxt = d.submit("next")
    assert nxt.work in executors[0].at_ranks
    assert [d.counts(i).in_flight for i in range(3)] == [2, 2, 2]


def test_no_healthy_replica_raises_at_once_with_causes():
    executors = [ManualExecutor(0), ManualExecutor(1)]
    executors[0].fail(EngineUnavailableError("rank 1 exited with code -9", reason="worker_exit", rank=1))
    executors[1].close()
    d = RequestDispatcher(executors)
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError) as info:
        d.submit("x")
    assert time.monotonic() - start < 0.5
    assert info.value.reason == "no_healthy_replica"
    assert "replica 0: rank 1 exited with code -9" in str(info.value)


def test_full_queues_shed_at_once_and_lose_nothing():
    executors = [ManualExecutor(i, max_ongoing=1, max_queued=2) for i in range(2)]
    d = RequestDispatcher(executors)
    admitted = [d.submit(k) for k in range(6)]
    for _ in range(3):
        start = time.monotonic()
        with pytest.raises(EngineOverloadedError, match=r"all 2 healthy replica\(s\) have full queues.*"
                                                        r"max_queued_requests=2") as info:
            d.submit("one too many")
        assert time.monotonic() - start < 0.05 and info.value.limit == 2 and info.value.queued == 4
    while any(e.at_ranks for e in executors):
        for e in executors:
            if e.at_ranks:
                e.finish_next("result")
    assert [f.result(timeout=0) for f in admitted] == ["ok"] * 6
    assert [(c.served, c.in_flight) for c in (d.counts(0), d.counts(1))] == [(3, 0), (3, 0)]


def test_cancelled_queued_request_wakes_waiters_and_never_launches():
    from concurrent.futures import wait

    e = ManualExecutor(0, max_ongoing=1, max_queued=None)
    d = RequestDispatcher([e])
    first, queued = d.submit("a"), d.submit("b")
    assert queued.cancel() and not first.cancel()
    done, _ = wait([queued], timeout=1)
    assert done == {queued}
    e.finish_next("result")
    assert e.launched == 1 and d.counts(0).in_flight == 0


def test_done_callback_runs_on_the_engines_thread_and_may_submit_again():
    e = ManualExecutor(0, max_ongoing=1, max_queued=None)
    d = RequestDispatcher([e])
    seen = {}

    def again(f):
        seen["thread"] = threading.current_thread().name
        seen["next"] = d.submit("from callback")

    d.submit("a").add_done_callback(again)
    e.finish_next("result")
    deadline = time.monotonic() + 5
    while "next" not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen["thread"] == "phyai-replica-0-callbacks" and seen["next"].work in e.at_ranks


@pytest.fixture
def tight_switching():
    """Threads switch every microsecond (not every 5 ms): a race between a pick and its count shows."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("round_", range(20))
def test_concurrent_submits_keep_exact_counts(round_, tight_switching):
    """8 threads submit 400 requests over 3 real replicas: the pick and its count are one step, so no two
    submits choose on the same count and the loads end 134 / 133 / 133 (run 200 times in a row: see
    docs/testing.md)."""
    executors = [ManualExecutor(i, max_queued=None) for i in range(3)]
    d = RequestDispatcher(executors)
    barrier = threading.Barrier(8)

    def client(k: int) -> None:
        barrier.wait()
        for j in range(50):
            d.submit((k, j))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loads = [d.counts(i).in_flight for i in range(3)]
    assert sorted(loads) == [133, 133, 134] and [d.load(i) for i in range(3)] == loads
    while any(e.at_ranks for e in executors):
        for e in executors:
            if e.at_ranks:
                e.finish_next("result")
    assert sum(d.counts(i).served for i in range(3)) == 400
    assert all(e.peak <= 2 for e in executors) and [d.load(i) for i in range(3)] == [0, 0, 0]


class FlappingReplica:
    """A stand-in replica for routing tests only: takes every request while healthy (its futures finish
    when the test says), refuses with EngineUnavailableError while not; the test flips `healthy` at any time."""

    max_queued, failure, serving = None, None, True

    def __init__(self, index: int) -> None:
        self.index, self.healthy = index, True
        self._lock = threading.Lock()
        self.accepted: list[Future] = []

    def submit(self, request, **kwargs) -> Future:
        if not self.healthy:
            raise EngineUnavailableError(f"replica {self.index} is down", reason="test")
        future: Future = Future()
        with self._lock:
            self.accepted.append(future)
        return future

    def has_room(self) -> bool:
        return True

    def unfinished(self) -> int:
        with self._lock:
            return sum(not f.done() for f in self.accepted)


def water_filled(loads: list[int], more: int) -> list[int]:
    """Where `more` requests end when each goes to a least-loaded replica, one at a time."""
    loads = list(loads)
    for _ in range(more):
        loads[loads.index(min(loads))] += 1
    return sorted(loads)


@settings(max_examples=25, deadline=None)
@given(replicas=st.integers(2, 6), threads=st.integers(2, 12), per_thread=st.integers(5, 40),
       flips=st.integers(0, 30), seed=st.integers(0, 2 ** 16))
def test_concurrent_routing_with_replicas_going_down_and_up_keeps_exact_counts(replicas, threads, per_thread,
                                                                              flips, seed):
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        _flapping_run(replicas, threads, per_thread, flips, seed)
    finally:
        sys.setswitchinterval(before)


def _flapping_run(replicas: int, threads: int, per_thread: int, flips: int, seed: int) -> None:
    """Threads submit while another flips replicas' health and a third finishes requests at random: every
    submit is either taken by exactly one replica or refused, the dispatcher's count of each replica equals
    its unfinished requests, and once all are healthy again a burst of concurrent submits fills the least
    loaded first (the multiset of loads is what one-at-a-time water filling gives)."""
    import random

    rng = random.Random(seed)
    fakes = [FlappingReplica(i) for i in range(replicas)]
    d = RequestDispatcher(fakes)
    barrier = threading.Barrier(threads + 2)
    outcomes: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client() -> None:
        barrier.wait()
        for _ in range(per_thread):
            try:
                d.submit("x")
                outcome = "taken"
            except (EngineUnavailableError, EngineOverloadedError):
                outcome = "refused"
            with lock:
                outcomes.append(outcome)

    def flapper() -> None:
        barrier.wait()
        for _ in range(flips):
            victim = fakes[rng.randrange(replicas)]
            victim.healthy = not victim.healthy
            time.sleep(0.0005)
        for f in fakes:
            f.healthy = True

    def finisher() -> None:
        barrier.wait()
        while not stop.is_set():
            victim = fakes[rng.randrange(replicas)]
            with victim._lock:
                open_ = [f for f in victim.accepted if not f.done()]
            if open_:
                rng.choice(open_).set_result("ok")
            time.sleep(0.0002)

    workers = [threading.Thread(target=client) for _ in range(threads)]
    helpers = [threading.Thread(target=flapper), threading.Thread(target=finisher)]
    for t in workers + helpers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    stop.set()
    for t in helpers:
        t.join(timeout=60)
    assert len(outcomes) == threads * per_thread
    assert outcomes.count("taken") == sum(len(f.accepted) for f in fakes)
    before = [f.unfinished() for f in fakes]
    assert [d.load(i) for i in range(replicas)] == before

    burst = threads * 10  # all healthy now: every pick is a least-loaded replica, one at a time
    barrier = threading.Barrier(threads)

    def burst_client() -> None:
        barrier.wait()
        for _ in range(10):
            d.submit("y")

    workers = [threading.Thread(target=burst_client) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    after = [f.unfinished() for f in fakes]
    assert sorted(after) == water_filled(before, burst) and [d.load(i) for i in range(replicas)] == after
    for f in fakes:
        for future in f.accepted:
            if not future.done():
                future.set_result("ok")
    assert [d.load(i) for i in range(replicas)] == [0] * replicas


def test_dispatcher_needs_an_executor():
    with pytest.raises(ValueError, match="at least one replica"):
        RequestDispatcher([])


def test_a_session_sticks_to_its_replica_while_it_serves():
    executors = [ManualExecutor(i, max_ongoing=8, max_queued=None) for i in range(3)]
    d = RequestDispatcher(executors)
    first = d.submit("a", session="episode-1")
    home = first.replica
    for k in range(5):  # other traffic makes `home` the busiest replica; the session stays anyway
        d.submit(k)
    assert all(d.submit(f"turn{t}", session="episode-1").replica == home for t in range(4))
    executors[home].control("pause", ("keep",), timeout_s=1, mode="keep")
    moved = d.submit("after pause", session="episode-1")
    assert moved.replica != home and d.submit("next", session="episode-1").replica == moved.replica
    d.max_sessions = 2
    for key in ("s2", "s3"):
        d.submit("x", session=key)
    assert "episode-1" not in d._sessions and list(d._sessions) == ["s2", "s3"]  # bounded LRU


def test_an_affinity_key_keeps_its_replica_within_the_slack_and_moves_past_it():
    """routing="affinity" (stand-in replicas): the 8 samples of a prompt go where its first went while that
    replica holds at most `affinity_slack` more unfinished requests than the least loaded; past it the key
    moves to the least loaded one (and stays there). Keys of other prompts spread by load as usual."""
    replicas = [FlappingReplica(i) for i in range(3)]
    d = RequestDispatcher(replicas, affinity_slack=2)
    first = d.submit("p0", affinity=(1, 2, 3))
    home = next(i for i, r in enumerate(replicas) if r.accepted)
    for k in range(2):  # two more of the same prompt: home holds 3, the others 0 -> 3 > 0 + 2 on the next
        d.submit(f"p0-{k}", affinity=(1, 2, 3))
    assert [len(r.accepted) for r in replicas][home] == 3
    moved = d.submit("p0-3", affinity=(1, 2, 3))
    new_home = next(i for i, r in enumerate(replicas) if moved in r.accepted)
    assert new_home != home and d.load(new_home) == 1
    d.submit("p0-4", affinity=(1, 2, 3))
    assert len(replicas[new_home].accepted) == 2  # the key followed the move
    for r in replicas:  # everything finishes: loads back to 0; the key's replica is the newest home
        for f in r.accepted:
            f.set_result(None)
    assert [d.load(i) for i in range(3)] == [0, 0, 0] and first.done()
    others = [d.submit(f"q{k}", affinity=("other", k)) for k in range(3)]  # distinct keys: one per replica
    assert sorted(sum(f in r.accepted for f in others) for r in replicas) == [1, 1, 1]
    with pytest.raises(TypeError):
        d.submit("x", affinity=["unhashable"])
