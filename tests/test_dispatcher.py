"""RequestDispatcher accounting and choice, driven by hypothesis over fake executors.

`FakeExecutor` is a replica whose health, refusal and futures the test controls. A stateful
hypothesis machine submits, completes, fails and cancels requests and flips health; after every
step the dispatcher's in-flight count of each replica must equal its unfinished futures, and each
choice must be the healthy replica with the fewest in-flight, ties to the least recently chosen.

Run: .venv/bin/pytest tests/test_dispatcher.py -q
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from phyai_ray.dispatcher import RequestDispatcher
from phyai_ray.errors import EngineUnavailableError
from phyai_ray.executors.base import ReplicaExecutor


class FakeExecutor(ReplicaExecutor):
    """A replica that hands out plain futures; the test finishes them and sets health by hand."""

    def __init__(self, index: int) -> None:
        super().__init__(index, world_size=1)
        self.up = True
        self.refuse = False  # raise EngineUnavailableError at submit (failed between check and send)
        self.broken = False  # raise a plain error at submit
        self.futures: list[tuple[object, Future]] = []

    @property
    def healthy(self) -> bool:
        return self.up and self._failure is None

    def submit(self, request):
        if self.refuse:
            raise EngineUnavailableError(f"replica {self.index} just failed", reason="worker_exit",
                                         replica=self.index)
        if self.broken:
            raise RuntimeError(f"replica {self.index} cannot serialize {request!r}")
        future: Future = Future()
        self.futures.append((request, future))
        return future

    def collective_rpc(self, method, args, kwargs, timeout_s, all_ranks=False):
        raise NotImplementedError

    def close(self) -> None:
        pass

    def unfinished(self) -> list[Future]:
        return [f for _, f in self.futures if not f.done()]


class DispatcherMachine(RuleBasedStateMachine):
    """Model of the dispatcher: expected last-chosen ticks, served and errored counts."""

    @initialize(n=st.integers(1, 4))
    def setup(self, n):
        self.executors = [FakeExecutor(i) for i in range(n)]
        self.dispatcher = RequestDispatcher(self.executors)
        self.last, self.tick = [-1] * n, 0
        self.served, self.errored = [0] * n, [0] * n

    def _in_flight(self, i: int) -> int:
        return len(self.executors[i].unfinished())

    def _expected_route(self) -> tuple[list[int], int | None, type | None]:
        """Replicas tried (in order) and the one that accepts, per the documented rule."""
        tried, candidates = [], [i for i, e in enumerate(self.executors) if e.healthy]
        while candidates:
            best = min(candidates, key=lambda i: (self._in_flight(i), self.last[i]))
            assert self._in_flight(best) == min(self._in_flight(i) for i in candidates)
            tried.append(best)
            if self.executors[best].broken and not self.executors[best].refuse:
                return tried, None, RuntimeError
            if not self.executors[best].refuse:
                return tried, best, None
            candidates.remove(best)
        return tried, None, EngineUnavailableError

    @rule()
    def submit(self):
        tried, accepted, error = self._expected_route()
        before = [f for e in self.executors for _, f in e.futures]
        if error is not None:
            with pytest.raises(error):
                self.dispatcher.submit(object())
        else:
            future = self.dispatcher.submit(("req", self.tick))
            assert future is self.executors[accepted].futures[-1][1]
        for i in tried:
            self.last[i], self.tick = self.tick, self.tick + 1
        assert len([f for e in self.executors for _, f in e.futures]) == len(before) + (error is None)

    def _pick(self, data) -> tuple[int, Future] | None:
        live = [(e.index, f) for e in self.executors for f in e.unfinished()]
        return data.draw(st.sampled_from(live)) if live else None

    @precondition(lambda self: any(e.unfinished() for e in self.executors))
    @rule(data=st.data(), how=st.sampled_from(["result", "exception", "cancel"]))
    def finish(self, data, how):
        index, future = self._pick(data)
        if how == "result":
            future.set_result("ok")
            self.served[index] += 1
        elif how == "exception":
            future.set_exception(ValueError("plugin rejected the payload"))
            self.errored[index] += 1
        else:
            assert future.cancel()

    @rule(data=st.data(), up=st.booleans(), refuse=st.booleans(), broken=st.booleans())
    def set_state(self, data, up, refuse, broken):
        e = data.draw(st.sampled_from(self.executors))
        e.up, e.refuse, e.broken = up, refuse, broken

    @invariant()
    def counts_match_unfinished_futures(self):
        for i in range(len(self.executors)):
            assert self.dispatcher.counts(i) == (self._in_flight(i), self.served[i], self.errored[i])


DispatcherMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestDispatcherMachine = DispatcherMachine.TestCase


# -- plain cases -----------------------------------------------------------------------------------

def test_least_in_flight_then_round_robin():
    executors = [FakeExecutor(i) for i in range(3)]
    d = RequestDispatcher(executors)
    chosen = []
    for k in range(6):
        d.submit(k)
        chosen.append(next(e.index for e in executors if e.futures and e.futures[-1][0] == k))
    assert chosen == [0, 1, 2, 0, 1, 2]
    executors[0].futures[0][1].set_result(None)  # replica 0 now has the fewest in flight
    d.submit("next")
    assert executors[0].futures[-1][0] == "next"
    assert [d.counts(i)[0] for i in range(3)] == [2, 2, 2]


def test_no_healthy_replica_raises_at_once_with_causes():
    executors = [FakeExecutor(0), FakeExecutor(1)]
    executors[0]._set_failure(EngineUnavailableError("rank 1 exited with code -9", reason="worker_exit", rank=1))
    executors[1].up = False
    d = RequestDispatcher(executors)
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError) as info:
        d.submit("x")
    assert time.monotonic() - start < 0.5
    assert info.value.reason == "no_healthy_replica"
    assert "no healthy replica among 2: replica 0: rank 1 exited with code -9" in str(info.value)
    assert d.counts(0) == d.counts(1) == (0, 0, 0)


def test_refusing_replica_is_skipped_and_counts_restored():
    executors = [FakeExecutor(0), FakeExecutor(1)]
    executors[0].refuse = True
    d = RequestDispatcher(executors)
    future = d.submit("x")
    assert executors[1].futures == [("x", future)]
    assert d.counts(0) == (0, 0, 0) and d.counts(1) == (1, 0, 0)
    executors[1].refuse = True
    with pytest.raises(EngineUnavailableError, match="all refused the request"):
        d.submit("y")
    assert d.counts(0) == (0, 0, 0) and d.counts(1) == (1, 0, 0)


def test_concurrent_submits_keep_exact_counts():
    executors = [FakeExecutor(i) for i in range(3)]
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
    loads = [d.counts(i)[0] for i in range(3)]
    assert sum(loads) == 400 and max(loads) - min(loads) <= 1
    assert loads == [len(e.futures) for e in executors]
    for e in executors:
        for _, f in e.futures:
            f.set_result(1)
    assert [d.counts(i) for i in range(3)] == [(0, len(e.futures), 0) for e in executors]


def test_dispatcher_needs_an_executor():
    with pytest.raises(ValueError, match="at least one replica executor"):
        RequestDispatcher([])
