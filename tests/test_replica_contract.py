"""The `Replica` contract: the engine and the dispatcher use nothing else, and anything that keeps it
is routed, even a replica with no scheduler and no queue of ours.

Read from the source with `ast`: `phyai_ray/engine.py`, `engine_control.py` and `dispatcher.py` never
read a private attribute of anything but themselves, never `.scheduler`, `.frontend` or `.queue`,
and what they read of a replica (the names `e`, `old`, `new`, `replica`) is a member of `Replica`.

Run: .venv/bin/pytest tests/test_replica_contract.py -q
"""

from __future__ import annotations

import ast
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from phyai_ray.dispatcher import RequestDispatcher
from phyai_ray.errors import EngineOverloadedError, EngineUnavailableError
from phyai_ray.executors.control import ReplicaState
from phyai_ray.executors.ledger import Counts
from phyai_ray.executors.replica import Replica

ROOT = Path(__file__).resolve().parents[1]
USERS = [ROOT / "phyai_ray" / name for name in ("engine.py", "engine_control.py", "dispatcher.py")]
REPLICA_NAMES = {"e", "old", "new", "replica"}  # how these modules name a replica
INTERNALS = {"scheduler", "frontend", "queue", "lifecycle", "ranks"}


def _members() -> set[str]:
    return {name for name in dir(Replica) if not name.startswith("_")} | set(Replica.__annotations__)


def _reads(path: Path) -> list[tuple[int, str, str]]:
    """(line, owner, attribute) of every attribute read of `path` whose owner is a plain name."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, node.value.id if isinstance(node.value, ast.Name) else "?", node.attr)
            for node in ast.walk(tree) if isinstance(node, ast.Attribute)]


@pytest.mark.parametrize("path", USERS, ids=lambda p: p.name)
def test_engine_and_dispatcher_use_only_the_replica_protocol(path: Path):
    assert path.exists(), f"{path} is gone: update USERS"
    members = _members()
    private = [(line, owner, attr) for line, owner, attr in _reads(path)
               if attr.startswith("_") and not attr.startswith("__") and owner not in ("self", "?")]
    internal = [(line, owner, attr) for line, owner, attr in _reads(path) if attr in INTERNALS]
    outside = [(line, owner, attr) for line, owner, attr in _reads(path)
               if owner in REPLICA_NAMES and attr not in members]
    assert not private, f"{path.name} reads private attributes of other objects: {private}"
    assert not internal, f"{path.name} reaches into a replica's parts: {internal}"
    assert not outside, f"{path.name} reads replica members that `Replica` does not declare: {outside}"


def test_the_checker_catches_a_reach_inside(tmp_path: Path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(e):\n    return e._life.pending_version, e.scheduler.max_queued, e.sneaky()\n")
    reads = _reads(bad)
    assert ("e", "_life") in {(o, a) for _, o, a in reads} and ("e", "scheduler") in {(o, a) for _, o, a in reads}
    assert "sneaky" not in _members() and "submit" in _members() and "index" in _members()


class FakeSelfScheduledReplica:
    """A replica that schedules itself: no queue or pipeline of ours. It answers each request
    with (its index, the request) when the test calls `serve()`, and holds at most `limit` at once."""

    world_size = 1
    max_queued = 2
    batching = iterative = False
    weight_version = pending_version = None

    def __init__(self, index: int) -> None:
        self.index = index
        self.held: list[tuple[Future, object]] = []
        self.served = self.errored = 0
        self.failure: EngineUnavailableError | None = None
        self._lock = threading.Lock()

    def submit(self, request, *, caller_runs=False, key=None, size=1, deadline=None, late="finish") -> Future:
        with self._lock:
            if self.failure is not None:
                raise self.unavailable_error()
            if len(self.held) >= self.max_queued:
                raise EngineOverloadedError(f"fake replica {self.index} is full", queued=len(self.held),
                                            limit=self.max_queued)
            future: Future = Future()
            future.replica = self.index
            self.held.append((future, request))
            return future

    def serve(self) -> None:
        with self._lock:
            held, self.held = self.held, []
        for future, request in held:
            future.set_result((self.index, request))
            self.served += 1

    def submit_stream(self, request, max_buffered):
        raise TypeError("the fake replica does not stream")

    def collective_rpc(self, method, args, kwargs, timeout_s, all_ranks=False) -> Future:
        raise TypeError("the fake replica has no ranks")

    def control(self, op, args=(), *, timeout_s, mode="wait"):
        raise TypeError("the fake replica has no control calls")

    def check_transition(self, op) -> None:
        pass

    def failed_report(self, op, error, started):
        return None

    def counts(self) -> Counts:
        with self._lock:
            return Counts(len(self.held), 0, self.served, self.errored)

    def has_room(self) -> bool:
        return self.healthy and len(self.held) < self.max_queued

    def carry_counts(self, replaced) -> None:
        self.served += replaced.counts().served

    def batch_stats(self) -> dict:
        return {}

    @property
    def healthy(self) -> bool:
        return self.failure is None

    @property
    def serving(self) -> bool:
        return self.healthy

    @property
    def state(self) -> ReplicaState:
        return ReplicaState.SERVING if self.healthy else ReplicaState.FAILED

    def unavailable_error(self) -> EngineUnavailableError:
        return EngineUnavailableError(f"fake replica {self.index} is unavailable: {self.failure}",
                                      reason="worker_exit", replica=self.index)

    def nodes(self) -> tuple:
        return ()

    def pids(self) -> tuple:
        return ()

    def close(self) -> None:
        self.failure = EngineUnavailableError("closed", reason="closed")


def test_a_replica_without_a_scheduler_is_routed_by_the_dispatcher():
    fakes = [FakeSelfScheduledReplica(0), FakeSelfScheduledReplica(1)]
    assert all(isinstance(f, Replica) for f in fakes) and not hasattr(fakes[0], "scheduler")
    d = RequestDispatcher(fakes)
    futures = [d.submit(k) for k in range(4)]  # least in flight, ties to the least recently chosen
    assert [f.replica for f in futures] == [0, 1, 0, 1]
    with pytest.raises(EngineOverloadedError, match=r"all 2 healthy replica\(s\) have full queues.*"
                                                    r"max_queued_requests=2") as info:
        d.submit("one too many")
    assert info.value.queued == 4 and info.value.limit == 2
    for fake in fakes:
        fake.serve()
    assert [f.result(timeout=0) for f in futures] == [(0, 0), (1, 1), (0, 2), (1, 3)]
    fakes[0].close()
    assert d.submit("after close").replica == 1  # a failed replica is skipped
    replacement = FakeSelfScheduledReplica(0)
    d.replace(0, replacement)
    assert replacement.counts().served == 2 and d.submit("on the new one").replica == 0


def test_no_healthy_fake_replica_raises_unavailable():
    fake = FakeSelfScheduledReplica(0)
    fake.close()
    with pytest.raises(EngineUnavailableError, match="no healthy replica among 1"):
        RequestDispatcher([fake]).submit("x")
