"""The request transports of a Ray replica, forced each way: same-node sockets (the default here), a compiled
graph, and actor calls (the fallback across nodes).

Run: `.venv/bin/pytest tests/test_transport.py` (starts one local Ray instance for the session).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import pytest
import torch

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       EngineUnavailableError, ParallelConfig, WorkerSupervisorConfig)
from tests.conftest import held
from tests.plugins.faults import RequestRejected, SlowTPEntry

pytestmark = pytest.mark.ray
THREE = torch.full((2,), 3.0)


def _engine(transport: str = "ipc", **proc) -> Engine:
    args = EngineArgs(plugin=SlowTPEntry, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    config = WorkerSupervisorConfig(request_transport=transport, **proc)
    return Engine(args, DeploymentConfig(mode="local", process_config=config))


@pytest.fixture(scope="module", params=["ipc", "compiled", "actor_calls"])
def healthy(request):
    """One replica per transport, shared by the tests that leave it healthy (pytest runs them transport by
    transport). The socket one is asked for as "auto" (one node: it must pick sockets) with 8 requests at
    the ranks at once, so writes can outgrow the socket buffer."""
    if request.param == "ipc":
        yield from held(lambda: _engine("auto", max_ongoing_requests=8))
    else:
        yield from held(lambda: _engine(request.param))


def ran(engine: Engine, before: list[list]) -> list[list]:
    """The tags each rank executed since `before` (an earlier `executed` rpc)."""
    now = engine.collective_rpc("executed", replica=0, all_ranks=True)
    return [tags[len(old):] for tags, old in zip(now, before)]


def test_every_transport_serve_in_order_with_large_requests_and_rpcs(healthy):
    engine = healthy
    big = torch.ones(2 ** 20)  # 4 MB: in shared memory (ipc) or as one ray.put reference (compiled)
    before, served = engine.collective_rpc("executed", replica=0, all_ranks=True), engine.replica_status()[0].served
    futures = [engine.submit({"sleep": 0, "tag": i, "big": big if i % 5 == 0 else None}) for i in range(40)]
    assert all(torch.equal(f.result(timeout=60), THREE) for f in futures)
    assert ran(engine, before) == [list(range(40))] * 2
    assert engine.collective_rpc("fail_on", 5, replica=0, all_ranks=True) == [0, 1]
    status = engine.replica_status()[0]
    assert (status.served - served, status.in_flight, status.healthy) == (40, 0, True)


@pytest.mark.parametrize("transport", ["ipc", "compiled", "actor_calls"])
def test_a_rank_exception_fails_the_replica_naming_rank_and_cause(ray_session, transport):
    with _engine(transport) as engine:
        with pytest.raises(EngineUnavailableError) as info:
            engine.collective_rpc("fail_on", 1, replica=0)
        error = info.value
        assert error.rank == 1 and error.reason == "exception"
        assert "raised RequestRejected" in str(error) and error.detail == "RequestRejected"
        assert "fails on purpose" not in str(error)  # the cause's type only: its message may quote a payload
        assert not engine.healthy


@pytest.mark.parametrize("transport", ["ipc", "compiled", "actor_calls"])
def test_a_killed_rank_fails_dispatched_work_within_two_seconds(ray_session, transport):
    import ray

    with _engine(transport, execution_timeout_s=60) as engine:
        engine.step({"sleep": 0})
        futures = [engine.submit({"sleep": 0.3}) for _ in range(6)]
        time.sleep(0.1)
        started = time.monotonic()
        ray.kill(engine._executors[0].ranks.actor(1), no_restart=True)
        done, _ = wait(futures, timeout=10)
        assert len(done) == 6 and time.monotonic() - started < 2.0
        errors = [f.exception() for f in futures if f.exception() is not None]
        assert errors and all(isinstance(e, EngineUnavailableError) and e.rank == 1 for e in errors)
        status = engine.replica_status()[0]
        assert (status.failure_reason, status.failed_rank, status.in_flight) == ("worker_exit", 1, 0)


def test_a_payload_that_does_not_serialize_fails_alone(healthy):
    engine, transport = healthy, healthy._executors[0].transport
    before = engine.replica_status()[0]
    if transport == "compiled":  # pickled on the way to the graph: the request fails, nothing else
        bad = engine.submit({"sleep": 0, "lock": threading.Lock()})
        assert isinstance(bad.exception(timeout=10), TypeError)
    else:  # pickled in the caller's thread: submit says so, nothing is queued
        with pytest.raises(TypeError, match="does not pickle" if transport == "ipc" else "serialize"):
            engine.submit({"sleep": 0, "lock": threading.Lock()})
    assert torch.equal(engine.step({"sleep": 0}), THREE)
    status = engine.replica_status()[0]
    assert (status.healthy, status.served - before.served, status.in_flight) == (True, 1, 0)
    assert status.errored - before.errored == (1 if transport == "compiled" else 0)


@pytest.mark.parametrize("transport", ["ipc", "compiled"])
def test_control_calls_beyond_the_lane_capacity_wait_in_order(ray_session, transport):
    with _engine(transport, max_ongoing_requests=1) as engine:
        first = engine.submit({"sleep": 0.5, "tag": "slow"})
        time.sleep(0.1)
        rpcs = [engine._executors[0].collective_rpc("whoami", (), {}, 30) for _ in range(20)]  # > 1 + 8 slots
        assert [f.result(timeout=30)["rank"] for f in rpcs] == [0] * 20
        assert torch.equal(first.result(timeout=10), THREE)
        assert engine.step({"sleep": 0, "tag": "after"}) is not None
        assert engine.collective_rpc("executed", replica=0) == ["slow", "after"]


SOCKETS = pytest.mark.parametrize("healthy", ["ipc"], indirect=True)


@SOCKETS
def test_sockets_share_large_tensors_copy_on_write_and_return_them_whole(healthy):
    engine, request = healthy, torch.ones(2 ** 20)  # 4 MB: one shared-memory copy, mapped by both ranks
    assert engine.collective_rpc("scribble", request, replica=0, all_ranks=True) == [4.0, 6.0]
    assert torch.equal(request, torch.ones(2 ** 20))  # the caller's tensor is untouched
    got = engine.collective_rpc("arange", 2 ** 21, replica=0, all_ranks=True)
    assert [torch.equal(t, torch.arange(2 ** 21, dtype=torch.float32) * (r + 1)) for r, t in enumerate(got)] == \
        [True, True]
    got[0].add_(1)  # a result is the caller's own, writable memory
    assert float(got[0][0]) == 1.0


def test_sockets_leak_no_descriptor_or_thread_over_create_close_cycles(ray_session):
    import os

    def count() -> tuple[int, int]:
        return len(os.listdir("/proc/self/fd")), threading.active_count()

    with _engine("ipc") as engine:  # warm: Ray's own connections and threads exist from here on
        engine.step({"sleep": 0, "big": torch.ones(2 ** 20)})
    before = count()
    for _ in range(3):  # one descriptor left per cycle would show as 3 more
        with _engine("ipc") as engine:
            futures = [engine.submit({"sleep": 0, "big": torch.ones(2 ** 19)}) for _ in range(8)]
            assert all(torch.equal(f.result(timeout=30), THREE) for f in futures)
    time.sleep(0.5)
    fds, threads = count()
    assert fds <= before[0] + 2 and threads <= before[1], (before, (fds, threads))


@SOCKETS
def test_sockets_keep_order_when_writes_outgrow_the_socket_buffer(healthy):
    # 240 KB bodies travel in the socket itself and several (8 at the ranks at once) fill its buffer: the
    # rest of each write waits in the lane's writer thread, in order, while submit never blocks
    engine, chunk = healthy, torch.ones(60_000)
    before = engine.collective_rpc("executed", replica=0, all_ranks=True)
    started = time.monotonic()
    futures = [engine.submit({"sleep": 0.01, "tag": i, "chunk": chunk}) for i in range(40)]
    assert time.monotonic() - started < 2.0
    assert all(torch.equal(f.result(timeout=60), THREE) for f in futures)
    assert ran(engine, before) == [list(range(40))] * 2


@SOCKETS
def test_auto_uses_sockets_on_one_node(healthy):
    assert healthy.deployment.process_config.request_transport == "auto"
    assert healthy._executors[0].transport == "ipc"
    assert torch.equal(healthy.step({"sleep": 0}), THREE)


@pytest.mark.parametrize("transport", ["ipc", "compiled", "actor_calls"])
def test_every_transport_stream_and_run_control_calls(ray_session, transport):
    from phyai_ray import AttentionParallelConfig

    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))
    args = EngineArgs(plugin="reference_lm", plugin_args={"seed": 0},
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))
    config = WorkerSupervisorConfig(request_transport=transport)
    with Engine(args, DeploymentConfig(mode="local", cpus_per_rank=0.5, process_config=config)) as engine:
        request = {"prompts": [[1, 2, 3]], "max_tokens": 6}
        [want] = engine.step(request)
        chunks = list(engine.stream(request))
        assert [c["token_ids"][0] for c in chunks] == want.token_ids
        assert [r.state for r in engine.pause()] == ["PAUSED"]
        assert [r.state for r in engine.resume()] == ["SERVING"]
        assert engine.step(request)[0].token_ids == want.token_ids
