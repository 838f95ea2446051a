"""The inline Engine: one rank in the caller's process, no Ray.

Run: .venv/bin/pytest tests/test_engine_inline.py -q
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import pytest
import torch

from phyai_ray import (DeploymentConfig, Engine, EngineArgs, EngineUnavailableError, RequestTimeoutError,
                       WorkerSupervisorConfig)
from phyai_ray.errors import DeploymentConfigError
from tests.plugins.tiny import ProbeError, reference

ROOT = Path(__file__).resolve().parents[1]
CPU = {"device": {"target": "cpu"}}


def probe_engine(timeout_s: float = 600.0, shutdown_s: float = 10.0, **plugin_args) -> Engine:
    proc = WorkerSupervisorConfig(execution_timeout_s=timeout_s, shutdown_timeout_s=shutdown_s)
    deployment = DeploymentConfig(process_config=proc)
    return Engine(EngineArgs(plugin="test_probe", plugin_args=plugin_args, config=CPU), deployment)


@pytest.fixture
def gate():
    event = threading.Event()
    yield event
    event.set()  # never leave a plugin thread blocked


def test_step_matches_reference():
    x = torch.arange(16, dtype=torch.float32).reshape(2, 8) - 5
    with Engine(EngineArgs(plugin="tiny_row_tp", config=CPU)) as engine:
        assert engine.mode == "inline"
        out = engine.step({"x": x})
        assert torch.equal(out, reference(x))
        assert torch.equal(engine.submit({"x": x * 2}).result(timeout=10), reference(x * 2))
        status = engine.replica_status()
    assert len(status) == 1 and status[0].healthy and status[0].served == 2 and status[0].in_flight == 0


def test_cancel_queued_request(gate):
    started = threading.Event()
    with probe_engine(gate=gate, started=started) as engine:
        running = engine.submit({"op": "block", "tag": "a"})
        assert started.wait(10)
        queued = engine.submit({"op": "echo", "tag": "b"})
        assert engine.replica_status()[0].in_flight == 2
        assert queued.cancel() and queued.cancelled()
        assert not running.cancel()  # already running
        assert engine.replica_status()[0].in_flight == 1
        gate.set()
        assert running.result(timeout=10) == {"index": 0, "tag": "a"}
        assert engine.step({"op": "echo", "tag": "c"}) == {"index": 1, "tag": "c"}  # b never ran
        assert engine.collective_rpc("history", replica=0) == ["a", "c"]
        status = engine.replica_status()[0]
    assert (status.in_flight, status.served, status.errored) == (0, 2, 0)


def test_plugin_exception_passes_through_and_engine_stays_healthy():
    with probe_engine() as engine:
        with pytest.raises(ProbeError, match="probe asked to fail: t1"):
            engine.step({"op": "raise", "tag": "t1"})
        future = engine.submit({"op": "raise", "tag": "t2"})
        assert type(future.exception(timeout=10)) is ProbeError
        assert engine.healthy
        assert engine.step({"op": "echo", "tag": "after"}) == {"index": 2, "tag": "after"}
        status = engine.replica_status()[0]
    assert (status.healthy, status.served, status.errored, status.failure) == (True, 1, 2, None)


def test_validator_rejects_synchronously_and_nothing_runs():
    with probe_engine() as engine:
        with pytest.raises(ValueError, match="test_probe requests need op in"):
            engine.submit({"op": "explode"})
        with pytest.raises(ValueError):
            engine.step("not a dict")
        assert engine.collective_rpc("history", replica=0) == []
        assert engine.replica_status()[0].in_flight == 0


def test_close_twice_then_unavailable():
    engine = probe_engine()
    engine.close()
    engine.close()
    assert not engine.healthy
    with pytest.raises(EngineUnavailableError) as info:
        engine.submit({"op": "echo"})
    assert info.value.reason == "closed"
    with pytest.raises(EngineUnavailableError, match="closed"):
        engine.step({"op": "echo"})
    with pytest.raises(EngineUnavailableError):
        engine.collective_rpc("history")


def test_close_cancels_queued_work(gate):
    started = threading.Event()
    engine = probe_engine(gate=gate, started=started)
    running = engine.submit({"op": "block", "tag": "a"})
    assert started.wait(10)
    queued = engine.submit({"op": "echo", "tag": "b"})
    threading.Timer(0.2, gate.set).start()
    engine.close()
    assert queued.cancelled()
    with pytest.raises(CancelledError):
        queued.result(timeout=1)
    assert running.result(timeout=1) == {"index": 0, "tag": "a"}  # the running call was allowed to finish


def test_close_with_a_stuck_plugin_is_bounded(gate):
    started = threading.Event()
    engine = probe_engine(shutdown_s=0.5, gate=gate, started=started)
    running = engine.submit({"op": "block", "tag": "stuck"})
    assert started.wait(10)
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 1.5
    assert running.exception(timeout=1).reason == "closed"


def test_execution_timeout_fails_the_replica(gate):
    deadline = 0.5
    with probe_engine(timeout_s=deadline, gate=gate) as engine:
        start = time.monotonic()
        future = engine.submit({"op": "block", "tag": "stuck"})
        error = future.exception(timeout=deadline + 5)
        elapsed = time.monotonic() - start
        assert isinstance(error, EngineUnavailableError) and error.reason == "timeout"
        assert deadline <= elapsed < deadline + 2, elapsed
        assert "running on its ranks for 0.5s, past the hang limit of 0.5s" in str(error)  # execution_timeout_s alone
        status = engine.replica_status()[0]
        assert (status.healthy, status.failure_reason, status.in_flight) == (False, "timeout", 0)
        assert not engine.healthy
        with pytest.raises(EngineUnavailableError) as later:
            engine.submit({"op": "echo"})
        assert later.value.reason == "no_healthy_replica" and "timeout" in str(later.value)


def test_work_queued_behind_a_timeout_never_runs(gate, monkeypatch):
    crashes, log, started = [], [], threading.Event()
    monkeypatch.setattr(threading, "excepthook", crashes.append)
    before = set(threading.enumerate())
    with probe_engine(timeout_s=0.3, gate=gate, started=started, log=log) as engine:
        first = engine.submit({"op": "block", "tag": "stuck"})
        queued = engine.submit({"op": "echo", "tag": "queued"})
        assert started.wait(10)
        assert isinstance(queued.exception(timeout=5), EngineUnavailableError)
        worker = next(t for t in set(threading.enumerate()) - before if t.name == "phyai-inline-0")
        gate.set()  # the stuck call returns; the failed queued call must be skipped
        worker.join(5)
    assert not worker.is_alive() and crashes == []
    assert log == ["stuck"]
    assert first.exception().reason == "timeout"


def test_timeout_counts_queueing_and_fails_only_that_request(gate):
    started = threading.Event()
    with probe_engine(timeout_s=1.0, gate=gate, started=started) as engine:
        first = engine.submit({"op": "sleep", "seconds": 0.7, "tag": "a"})
        queued = engine.submit({"op": "sleep", "seconds": 0.7, "tag": "b"})  # would end at ~1.4 s
        error = queued.exception(timeout=5)
        assert isinstance(error, RequestTimeoutError) and isinstance(error, TimeoutError)
        assert "1.0" in str(error) and error.replica == 0
        assert first.result(timeout=5)["tag"] == "a"
        assert engine.healthy and engine.step({"op": "echo", "tag": "c"})["tag"] == "c"
        status = engine.replica_status()[0]
        assert (status.in_flight, status.served, status.errored) == (0, 2, 1)


def test_queued_request_past_its_deadline_never_runs(gate):
    started, log = threading.Event(), []
    with probe_engine(timeout_s=0.5, gate=gate, started=started, log=log) as engine:
        engine.submit({"op": "sleep", "seconds": 0.3, "tag": "a"})
        late = [engine.submit({"op": "sleep", "seconds": 0.3, "tag": f"late{i}"}) for i in range(5)]
        for f in late[1:]:
            assert isinstance(f.exception(timeout=5), RequestTimeoutError)
        assert engine.healthy and engine.step({"op": "echo", "tag": "next"})["tag"] == "next"
    assert "late4" not in log and log[-1] == "next"


def test_collective_rpc():
    with probe_engine() as engine:
        assert engine.collective_rpc("add", 2, b=3) == [5]
        assert engine.collective_rpc("add", 2, replica=0) == 2
        assert engine.collective_rpc("add", 1, 1, replica=0, all_ranks=True) == [2]
        with pytest.raises(AttributeError, match="has no public method 'missing'"):
            engine.collective_rpc("missing", replica=0)
        with pytest.raises(AttributeError, match="no public method '_private'"):
            engine.collective_rpc("_private", replica=0)
        with pytest.raises(ValueError, match="replica=1 is out of range; this engine has 1 replica"):
            engine.collective_rpc("add", 1, replica=1)
        assert engine.healthy


def test_collective_rpc_timeout_names_its_own_limit_and_keeps_the_replica(gate):
    started = threading.Event()
    with probe_engine(gate=gate, started=started) as engine:
        engine.submit({"op": "block", "tag": "first"})
        assert started.wait(10)
        start = time.monotonic()
        with pytest.raises(RequestTimeoutError, match=r"collective_rpc timeout=0.3") as info:
            engine.collective_rpc("add", 1, replica=0, timeout=0.3)
        assert info.value.dispatched and time.monotonic() - start < 1.3
        gate.set()
        assert engine.healthy and engine.collective_rpc("add", 2, replica=0) == 2


def test_collective_rpc_jumps_ahead_of_queued_requests(gate):
    started = threading.Event()
    with probe_engine(gate=gate, started=started) as engine:
        engine.submit({"op": "block", "tag": "first"})
        assert started.wait(10)
        second = engine.submit({"op": "echo", "tag": "second"})
        threading.Timer(0.2, gate.set).start()
        assert engine.collective_rpc("history", replica=0) == ["first"]  # after the running one, before "second"
        assert second.result(timeout=5)["tag"] == "second"
        assert engine.collective_rpc("history", replica=0) == ["first", "second"]


def test_many_threads_keep_their_order():
    threads, per_thread = 8, 30
    barrier = threading.Barrier(threads)
    results: dict[int, list] = {}
    with probe_engine() as engine:
        def client(k: int) -> None:
            barrier.wait()
            futures = [engine.submit({"op": "echo", "tag": (k, j)}) for j in range(per_thread)]
            results[k] = [f.result(timeout=30) for f in futures]

        workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        history = engine.collective_rpc("history", replica=0)
    assert len(history) == threads * per_thread and len(set(history)) == len(history)
    for k in range(threads):
        assert [r["tag"] for r in results[k]] == [(k, j) for j in range(per_thread)]  # own result
        indices = [r["index"] for r in results[k]]
        assert indices == sorted(indices)  # the plugin saw each thread's requests in its order
        assert [history[i] for i in indices] == [(k, j) for j in range(per_thread)]


def test_inline_mode_with_two_ranks_is_an_error():
    args = EngineArgs(plugin="tiny_row_tp", config={**CPU, "parallel": {"dense": {"tp_size": 2}}})
    with pytest.raises(DeploymentConfigError, match="mode='inline' runs one rank"):
        Engine(args, DeploymentConfig(mode="inline"))


def _run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_import_phyai_ray_imports_neither_ray_nor_torch():
    _run("import phyai_ray, sys; assert 'ray' not in sys.modules, 'ray'; assert 'torch' not in sys.modules, 'torch'; "
         "dir(phyai_ray); phyai_ray.ParallelConfig; assert 'ray' not in sys.modules")


def test_inline_engine_does_not_import_ray():
    _run("import sys\n"
         "from phyai_ray import Engine, EngineArgs\n"
         "with Engine(EngineArgs(plugin='tests.plugins.tiny:TinyRowTPEntry', config={'device': {'target': 'cpu'}})) "
         "as e:\n"
         "    assert e.mode == 'inline'\n"
         "    assert e.step({'x': [[1.0] * 8]}).shape == (1, 4)\n"
         "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))\n")


def test_step_runs_on_the_callers_thread_when_idle_and_submit_keeps_the_worker():
    with probe_engine() as engine:
        assert engine.step({"op": "thread"}) == threading.current_thread().name
        assert engine.submit({"op": "thread"}).result(timeout=10) == "phyai-inline-0"
        status = engine.replica_status()[0]
    assert (status.served, status.in_flight) == (2, 0)


def test_step_behind_running_work_waits_its_turn(gate):
    started = threading.Event()
    with probe_engine(gate=gate, started=started) as engine:
        running = engine.submit({"op": "block", "tag": "a"})
        assert started.wait(10)
        threading.Timer(0.2, gate.set).start()
        assert engine.step({"op": "thread"}) == "phyai-inline-0"  # something was running: the worker ran it
        assert running.result(timeout=5)["tag"] == "a"
        assert engine.collective_rpc("history", replica=0) == ["a", None]


def test_a_step_stuck_on_the_callers_thread_still_fails_the_replica_in_time(gate):
    deadline, started = 0.5, threading.Event()
    with probe_engine(timeout_s=deadline, gate=gate, started=started) as engine:
        outcome: list[BaseException] = []

        def caller() -> None:
            try:
                engine.step({"op": "block", "tag": "stuck"})
            except BaseException as exc:
                outcome.append(exc)

        stuck = threading.Thread(target=caller)
        stuck.start()
        assert started.wait(10)
        assert engine.replica_status()[0].dispatched == 1  # counted as running while on the caller's thread
        start = time.monotonic()
        other = engine.submit({"op": "echo", "tag": "behind"})
        error = other.exception(timeout=deadline + 5)
        assert isinstance(error, EngineUnavailableError) and error.reason == "timeout"
        assert time.monotonic() - start < deadline + 2
        status = engine.replica_status()[0]
        assert (status.healthy, status.in_flight) == (False, 0)
        gate.set()
        stuck.join(5)
    assert isinstance(outcome[0], EngineUnavailableError) and outcome[0].reason == "timeout"


def test_steps_and_submits_from_many_threads_never_overlap_and_keep_their_order():
    threads, per_thread = 6, 40
    barrier = threading.Barrier(threads)
    results: dict[int, list] = {}
    with probe_engine() as engine:
        def client(k: int) -> None:
            barrier.wait()
            out = []
            for j in range(per_thread):
                request = {"op": "echo", "tag": (k, j)}
                out.append(engine.step(request) if (k + j) % 2 else engine.submit(request).result(timeout=30))
            results[k] = out

        workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        history = engine.collective_rpc("history", replica=0)
        assert engine.collective_rpc("concurrency", replica=0) == 1
        status = engine.replica_status()[0]
    assert len(history) == threads * per_thread and status.served == threads * per_thread
    for k in range(threads):
        assert [r["tag"] for r in results[k]] == [(k, j) for j in range(per_thread)]
        indices = [r["index"] for r in results[k]]
        assert indices == sorted(indices)


def test_a_paused_inline_replica_holds_even_caller_thread_steps():
    with probe_engine() as engine:
        engine.pause()
        box = {}
        caller = threading.Thread(target=lambda: box.setdefault("out", engine.step({"op": "echo", "tag": "held"})))
        caller.start()
        caller.join(0.3)
        assert caller.is_alive() and engine.replica_status()[0].queued == 1
        engine.resume()
        caller.join(5)
        assert box["out"]["tag"] == "held"
