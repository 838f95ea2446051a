"""Ray replica groups on CPU with gloo: routing, parallel correctness, fail-fast, cleanup.

Run: `.venv/bin/pytest tests/test_ray_replicas.py` (starts one local Ray instance for the session).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import wait

import pytest
import torch

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeploymentConfigError, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       EngineUnavailableError, ParallelConfig, StartupError, WorkerSupervisorConfig)
from phyai_ray.errors import RequestRejectedError
from tests.conftest import live_actors, live_placement_groups
from tests.plugins.faults import CreateFailed, FailCreateEntry, RequestRejected, SlowTPEntry
from tests.plugins.tiny import TinyRowTPEntry, reference
from tests.tolerances import reordered

pytestmark = pytest.mark.ray


def _args(entry, tp: int = 2, **plugin_args) -> EngineArgs:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp)) if tp > 1 else ParallelConfig()
    return EngineArgs(plugin=entry, plugin_args=plugin_args,
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))


def _deploy(replicas: int = 2, **proc) -> DeploymentConfig:
    return DeploymentConfig(replica_count=replicas, process_config=WorkerSupervisorConfig(**proc))


def test_two_replicas_tp2_equal_single_rank_and_share_load(ray_session):
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(50)]
    with Engine(_args(TinyRowTPEntry, tp=1)) as single:
        assert single.mode == "inline"
        expected = [single.step({"x": x}) for x in xs]
    with Engine(_args(TinyRowTPEntry, tp=2), _deploy(2)) as engine:
        assert engine.mode == "local"
        futures = [engine.submit({"x": x}) for x in xs]
        results = [f.result(timeout=60) for f in futures]
        status = engine.replica_status()
    for got, want, x in zip(results, expected, xs):  # 8-term sums split over two ranks and all-reduced
        torch.testing.assert_close(got, want, **reordered(torch.float32, terms=8, like=want))
        torch.testing.assert_close(got, reference(x), **reordered(torch.float32, terms=8, like=want))
    assert all(s.served > 0 for s in status), status
    assert sum(s.served for s in status) == 50
    assert all(s.world_size == 2 and s.in_flight == 0 and s.healthy for s in status)
    pids = [pid for s in status for pid in s.pids]
    assert len(pids) == 4 and len(set(pids)) == 4 and os.getpid() not in pids


def test_auto_mode_picks_local_for_one_rank_two_replicas_and_rpc_reaches_every_rank(ray_session):
    with Engine(_args(TinyRowTPEntry, tp=1), DeploymentConfig(replica_count=2)) as engine:
        assert engine.mode == "local"
        shards = engine.collective_rpc("shard")
        assert [s["cols"] for s in shards] == [[0, 8], [0, 8]]
        per_rank = engine.collective_rpc("shard", replica=1, all_ranks=True)
        assert [s["rank"] for s in per_rank] == [0]
        with pytest.raises(AttributeError, match="no public method 'nope'"):
            engine.collective_rpc("nope", replica=0)
        assert all(s.healthy for s in engine.replica_status())  # a missing method is not a failure


def test_validator_rejection_raises_the_typed_rejection_and_group_keeps_serving(ray_session):
    with Engine(_args(SlowTPEntry), _deploy(1, execution_timeout_s=30)) as engine:
        with pytest.raises(RequestRejectedError, match="sleep") as info:
            engine.submit({"sleep": -1})
        assert isinstance(info.value.__cause__, RequestRejected) and info.value.plugin == "slow_tp"
        torch.testing.assert_close(engine.step({"sleep": 0}), torch.full((2,), 3.0))
        tp = engine.collective_rpc("whoami", replica=0, all_ranks=True)
        assert [t["rank"] for t in tp] == [0, 1]
        assert engine.replica_status()[0].healthy


@pytest.mark.parametrize("how", ["ray_kill", "sigkill"])
def test_killed_rank_fails_its_inflight_requests_fast_and_other_replica_serves(ray_session, how):
    import ray

    with Engine(_args(SlowTPEntry), _deploy(2, execution_timeout_s=60)) as engine:
        engine.step({"sleep": 0})
        futures = [engine.submit({"sleep": 0.5}) for _ in range(8)]
        victim = engine._executors[0]
        doomed = [f for f in futures if f in _futures_of(engine, victim, futures)]
        started = time.monotonic()
        if how == "ray_kill":
            ray.kill(victim.ranks.actor(1), no_restart=True)
        else:
            os.kill(victim.pids()[1], signal.SIGKILL)
        done, _ = wait(futures, timeout=30)
        assert len(done) == 8
        failed = [f for f in futures if f.exception() is not None]
        assert failed, "killing a rank failed no request"
        for f in failed:
            error = f.exception()
            assert isinstance(error, EngineUnavailableError), error
            assert error.replica == 0 and error.rank == 1 and "rank 1" in str(error)
        assert time.monotonic() - started < 5.0
        assert len(failed) >= len(doomed) - 1  # at most the one that finished before the kill landed
        status = engine.replica_status()
        assert not status[0].healthy and status[0].failure_reason == "worker_exit" and status[0].failed_rank == 1
        results = [f.result(timeout=30) for f in [engine.submit({"sleep": 0}) for _ in range(50)]]
        assert all(torch.equal(r, torch.full((2,), 3.0)) for r in results)
        assert engine.replica_status()[1].in_flight == 0


def _futures_of(engine, executor, futures):
    return {w.future for w in executor.pipeline.dispatched_work()} | {f for f in futures if f.work in
                                                                       executor.queue._queued}


def test_execution_timeout_fails_group_within_two_seconds_of_deadline(ray_session):
    with Engine(_args(SlowTPEntry), _deploy(1, execution_timeout_s=1.5)) as engine:
        started = time.monotonic()
        future = engine.submit({"sleep": 30})
        with pytest.raises(EngineUnavailableError) as info:
            future.result(timeout=10)
        elapsed = time.monotonic() - started
        assert 1.5 <= elapsed <= 3.5, elapsed
        assert info.value.reason == "timeout" and "past the hang limit of 1.5s" in str(info.value)
        with pytest.raises(EngineUnavailableError, match="no healthy replica"):
            engine.submit({"sleep": 0})
        assert not engine.healthy


def test_collective_rpc_timeout_fails_the_replica_and_names_its_own_limit(ray_session):
    with Engine(_args(SlowTPEntry), _deploy(1, execution_timeout_s=60)) as engine:
        assert engine.collective_rpc("nap", 0.0, replica=0) == 0.0
        started = time.monotonic()
        with pytest.raises(EngineUnavailableError, match=r"collective_rpc timeout of 1.0s") as info:
            engine.collective_rpc("nap", 30.0, timeout=1.0)
        assert time.monotonic() - started < 3.0 and info.value.reason == "timeout"
        assert not engine.healthy


def test_create_failure_on_rank1_fails_start_and_leaves_nothing(ray_session):
    started = time.monotonic()
    with pytest.raises(StartupError) as info:
        Engine(_args(FailCreateEntry, fail_rank=1), _deploy(1, startup_timeout_s=60))
    assert time.monotonic() - started < 45
    message = str(info.value)
    assert "rank 1" in message and "CreateFailed" in message and "refuses to build" in message
    assert isinstance(info.value.__cause__, CreateFailed)
    assert info.value.rank == 1


def test_impossible_local_plan_fails_at_once_with_the_numbers(ray_session):
    started = time.monotonic()
    with pytest.raises(DeploymentConfigError, match=r"no node can hold one whole replica.*'CPU': 128.*ray status"):
        Engine(_args(TinyRowTPEntry, tp=2), DeploymentConfig(mode="local", cpus_per_rank=64))
    with pytest.raises(DeploymentConfigError, match=r"3 replica\(s\) need \{'CPU': 12.0\}.*ray status"):
        Engine(_args(TinyRowTPEntry, tp=2), DeploymentConfig(mode="local", replica_count=3, cpus_per_rank=2))
    assert time.monotonic() - started < 2


def test_unplaceable_cluster_replica_times_out_with_hint_and_leaves_nothing(ray_session):
    deployment = DeploymentConfig.cluster(address="auto", cpus_per_rank=64,
                                          process_config=WorkerSupervisorConfig(startup_timeout_s=2))
    started = time.monotonic()
    with pytest.raises(StartupError, match="not placed within 2s.*ray status"):
        Engine(_args(TinyRowTPEntry, tp=1), deployment)
    assert time.monotonic() - started < 6


def test_create_step_close_cycles_leave_no_actors_or_placement_groups(ray_session):
    import os
    import threading

    held = []  # (open file descriptors, threads) of this process after each cycle
    for i in range(10):  # a descriptor or thread left per cycle shows as 7 more after cycle 3
        engine = Engine(_args(TinyRowTPEntry, tp=1), DeploymentConfig(mode="local"))
        assert engine._executors[0].transport == "ipc"  # the default request path on one node
        x = torch.full((1, 8), float(i))
        torch.testing.assert_close(engine.step({"x": x}), reference(x))
        engine.close()
        engine.close()
        held.append((len(os.listdir("/proc/self/fd")), threading.active_count()))
    deadline = time.monotonic() + 15
    while (live_actors() or live_placement_groups()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_actors() == [] and live_placement_groups() == []
    # sockets and threads of closed engines are gone (Ray's own connections settle after the first cycles)
    assert held[-1][0] <= held[2][0] + 3 and held[-1][1] <= held[2][1], held


def test_close_from_eight_threads_during_200_submits_resolves_everything(ray_session):
    engine = Engine(_args(SlowTPEntry), _deploy(2, execution_timeout_s=60))
    futures, refused = [], []

    def submitter():
        for _ in range(25):
            try:
                futures.append(engine.submit({"sleep": 0.01}))
            except EngineUnavailableError:
                refused.append(1)

    submitters = [threading.Thread(target=submitter) for _ in range(8)]
    closers = [threading.Thread(target=engine.close) for _ in range(8)]
    for t in submitters:
        t.start()
    time.sleep(0.2)
    started = time.monotonic()
    for t in closers:
        t.start()
    for t in submitters + closers:
        t.join(timeout=20)
    done, not_done = wait(futures, timeout=10)
    assert not not_done and time.monotonic() - started < 10
    assert len(futures) + len(refused) == 200
    for f in futures:  # queued work is cancelled by close, dispatched work fails with the cause
        assert f.cancelled() or f.exception() is None or isinstance(f.exception(), EngineUnavailableError)
    assert all(s.in_flight == 0 for s in engine.replica_status())


def test_engine_inside_a_ray_actor_works_the_same(ray_session):
    import ray

    @ray.remote(num_cpus=0)
    class PhyaiOwner:
        def run(self):
            from phyai_ray import Engine
            from tests.plugins.tiny import reference
            with Engine(_args(TinyRowTPEntry, tp=2), DeploymentConfig(replica_count=1)) as engine:
                x = torch.ones(2, 8)
                return engine.mode, bool(torch.allclose(engine.step({"x": x}), reference(x)))

    owner = PhyaiOwner.remote()
    assert ray.get(owner.run.remote(), timeout=120) == ("local", True)
    ray.kill(owner)


def test_restart_replica_replaces_only_a_failed_group(ray_session):
    import ray

    with Engine(_args(SlowTPEntry), _deploy(2, execution_timeout_s=60)) as engine:
        with pytest.raises(ValueError, match="replica 1 is healthy"):
            engine.restart_replica(1)
        old_pids = engine.replica_status()[0].pids
        ray.kill(engine._executors[0].ranks.actor(0), no_restart=True)
        deadline = time.monotonic() + 5
        while engine.replica_status()[0].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.replica_status()[0].failure_reason == "worker_exit"
        engine.restart_replica(0)
        status = engine.replica_status()
        assert status[0].healthy and set(status[0].pids).isdisjoint(old_pids)
        results = [f.result(timeout=30) for f in [engine.submit({"sleep": 0.05}) for _ in range(10)]]
        assert all(torch.equal(r, torch.full((2,), 3.0)) for r in results)
        after = engine.replica_status()
        assert after[0].served > 0 and after[1].served > 0
    with Engine(_args(TinyRowTPEntry, tp=1)) as inline:
        with pytest.raises(DeploymentConfigError, match="restart_replica needs Ray replica groups"):
            inline.restart_replica(0)
