"""Ray replica groups under load: bounded dispatch, shedding, two clocks, control lane, callbacks.

Real rank actors on CPU with gloo (`slow_tp` sleeps, then all-reduces over dense_tp).

Run: `.venv/bin/pytest tests/test_load.py` (starts one local Ray instance for the session).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import wait

import pytest
import torch

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       EngineOverloadedError, EngineUnavailableError, ParallelConfig, RequestTimeoutError,
                       WorkerSupervisorConfig)
from tests.plugins.faults import SlowTPEntry

pytestmark = pytest.mark.ray
THREE = torch.full((2,), 3.0)  # slow_tp's result at TP=2: (1 + 2) on every element


def _engine(tp: int = 2, replicas: int = 1, cpus: float = 1.0, **proc) -> Engine:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp)) if tp > 1 else ParallelConfig()
    args = EngineArgs(plugin=SlowTPEntry, config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))
    return Engine(args, DeploymentConfig(mode="local", replica_count=replicas, cpus_per_rank=cpus,
                                         process_config=WorkerSupervisorConfig(**proc)))


def _held(engine: Engine, replica: int = 0) -> list[tuple[int, int]]:
    """(held now, peak held) of every rank of `replica`, asked over the control lane."""
    import ray

    executor = engine._executors[replica]
    return ray.get([executor.ranks.actor(r).held.remote() for r in range(executor.world_size)], timeout=10)


CALLBACK_LAG_S = 0.25  # how far a done-callback may trail the event on a loaded machine


def _finish_times(futures) -> dict:
    """future -> when it finished (stamped by a done-callback; `_all_stamped` waits for the last ones)."""
    times: dict = {}
    for f in futures:
        f.add_done_callback(lambda f: times.setdefault(f, time.monotonic()))
    return times


def _all_stamped(times: dict, n: int) -> dict:
    deadline = time.monotonic() + 5
    while len(times) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return times


def test_two_thousand_at_once_all_succeed_and_ranks_hold_at_most_max_ongoing(ray_session):
    with _engine(execution_timeout_s=300) as engine:
        futures = [engine.submit({"sleep": 0.005}) for _ in range(2000)]
        status = engine.replica_status()[0]
        assert status.queued >= 1900 and status.dispatched <= 2 and status.in_flight == 2000 - status.served
        done, not_done = wait(futures, timeout=240)
        assert not not_done
        assert all(torch.equal(f.result(), THREE) for f in futures)
        status = engine.replica_status()[0]
        assert status.healthy and status.served == 2000 and status.in_flight == 0
        held = _held(engine)
        assert all(peak <= 2 for _, peak in held), held  # never more than max_ongoing_requests at a rank
        assert all(peak >= 2 for _, peak in held), held  # and the pipeline was used: the next one was ready


def test_queue_deeper_than_the_deadline_times_out_requests_not_the_group(ray_session):
    with _engine(execution_timeout_s=5) as engine:
        engine.step({"sleep": 0})
        submitted = {}
        futures = []
        for i in range(12):
            submitted_at = time.monotonic()
            future = engine.submit({"sleep": 1.0, "tag": i})
            submitted[future] = submitted_at
            futures.append(future)
        times = _finish_times(futures)
        wait(futures, timeout=30)
        _all_stamped(times, len(futures))
        ok = [f for f in futures if f.exception() is None]
        late = [f for f in futures if f.exception() is not None]
        assert len(ok) >= 4, [f.exception() for f in futures]
        for f in late:
            assert isinstance(f.exception(), RequestTimeoutError), f.exception()
            assert abs(times[f] - (submitted[f] + 5)) <= 0.5, times[f] - submitted[f]
        assert engine.replica_status()[0].healthy
        started = time.monotonic()
        assert torch.equal(engine.step({"sleep": 0}, timeout=10), THREE)
        # at most max_ongoing_requests expired requests were already at the ranks; they finish first
        assert time.monotonic() - started < 2 * 1.0 + 1.0
        status = engine.replica_status()[0]
        assert (status.healthy, status.served, status.errored, status.in_flight) == (True, 1 + len(ok) + 1,
                                                                                     len(late), 0)
        executed = set(engine.collective_rpc("executed", replica=0))
        never_sent = [i for i, f in enumerate(futures) if f.exception() is not None and not f.exception().dispatched]
        assert never_sent and not set(never_sent) & executed  # dropped before reaching a rank
        assert {i for i, f in enumerate(futures) if f.exception() is None} <= executed


def test_two_replicas_thirty_slow_requests_no_group_is_killed(ray_session):
    with _engine(tp=2, replicas=2, cpus=0.5, execution_timeout_s=5) as engine:
        futures = [engine.submit({"sleep": 1.0}) for _ in range(30)]
        wait(futures, timeout=30)
        errors = [f.exception() for f in futures if f.exception() is not None]
        assert all(isinstance(e, RequestTimeoutError) for e in errors), errors
        assert len(futures) - len(errors) >= 8
        assert all(s.healthy for s in engine.replica_status())
        assert [torch.equal(engine.step({"sleep": 0}, timeout=10), THREE) for _ in range(2)] == [True, True]


def test_full_queues_shed_within_50ms_and_every_admitted_request_completes(ray_session):
    with _engine(tp=1, replicas=2, cpus=0.5, max_queued_requests=8, max_ongoing_requests=2,
                 execution_timeout_s=60) as engine:
        admitted, shed_s = [], []
        for i in range(40):
            started = time.monotonic()
            try:
                admitted.append(engine.submit({"sleep": 0.2, "tag": i}))
            except EngineOverloadedError as exc:
                shed_s.append(time.monotonic() - started)
                assert "max_queued_requests=8" in str(exc)
        assert len(admitted) == 2 * (8 + 2) and len(shed_s) == 20
        assert max(shed_s) < 0.05, shed_s
        assert all(torch.equal(f.result(timeout=30), torch.ones(2)) for f in admitted)
        assert all(s.healthy and s.in_flight == 0 and s.errored == 0 for s in engine.replica_status())
        assert sum(s.served for s in engine.replica_status()) == 20


def test_done_callback_that_calls_step_completes(ray_session):
    with _engine(tp=2, execution_timeout_s=30) as engine:
        out, finished = [], threading.Event()

        def callback(future):
            out.append(engine.step({"sleep": 0}, timeout=10))
            out.append(engine.submit({"sleep": 0}).result(timeout=10))
            finished.set()

        engine.submit({"sleep": 0.05}).add_done_callback(callback)
        assert finished.wait(20)
        assert [torch.equal(o, THREE) for o in out] == [True, True]
        assert engine.replica_status()[0].healthy


def test_cancel_queued_requests_they_never_run_accounting_exact(ray_session):
    with _engine(tp=2, execution_timeout_s=60) as engine:
        futures = [engine.submit({"sleep": 0.3, "tag": i}) for i in range(10)]
        deadline = time.monotonic() + 10
        while engine.replica_status()[0].dispatched < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        dispatched = [f for f in futures if f.running()]
        queued = [f for f in futures if not f.running() and not f.done()]
        assert len(dispatched) == 2 and len(queued) == 8
        assert not any(f.cancel() for f in dispatched)
        assert all(f.cancel() for f in queued[:6])
        status = engine.replica_status()[0]
        assert status.queued == 2 and status.in_flight <= 4
        wait(futures, timeout=20)
        ran = engine.collective_rpc("executed", replica=0, all_ranks=True)
        cancelled_tags = {futures.index(f) for f in queued[:6]}
        for per_rank in ran:
            assert len(per_rank) == 4 and not cancelled_tags & set(per_rank), per_rank
        status = engine.replica_status()[0]
        assert (status.served, status.errored, status.in_flight) == (4, 0, 0)


@pytest.mark.parametrize("how", ["ray_kill", "sigkill"])
def test_with_a_thousand_queued_control_and_failure_stay_fast(ray_session, how):
    import ray

    with _engine(tp=2, replicas=1, execution_timeout_s=300) as engine:
        futures = [engine.submit({"sleep": 0.05}) for _ in range(1000)]
        started = time.monotonic()
        status = engine.replica_status()
        assert time.monotonic() - started < 0.05 and status[0].queued >= 900
        started = time.monotonic()
        assert engine.collective_rpc("nap", 0.0, replica=0, timeout=5) == 0.0
        assert time.monotonic() - started < 1.0
        victim = engine._executors[0]
        killed = time.monotonic()
        if how == "ray_kill":
            ray.kill(victim.ranks.actor(1), no_restart=True)
        else:
            os.kill(victim.pids()[1], signal.SIGKILL)
        deadline = killed + 10
        while engine.replica_status()[0].healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        noticed = time.monotonic() - killed
        status = engine.replica_status()[0]
        assert not status.healthy and noticed < 2.0, noticed
        assert status.failure_reason == "worker_exit" and status.failed_rank == 1
        done, not_done = wait(futures, timeout=5)
        assert not not_done and engine.replica_status()[0].in_flight == 0
        failed = [f.exception() for f in futures if f.exception() is not None]
        assert len(failed) >= 900 and all(isinstance(e, EngineUnavailableError) and e.rank == 1 for e in failed)


def test_a_step_stuck_running_fails_the_group_within_1s_of_its_limit(ray_session):
    with _engine(tp=2, execution_timeout_s=3) as engine:
        engine.step({"sleep": 0})
        ahead = [engine.submit({"sleep": 0.5}) for _ in range(2)]
        times = _finish_times(ahead)
        stuck = engine.submit({"sleep": 30})
        assert isinstance(stuck.exception(timeout=10), RequestTimeoutError)  # its own clock: from submission
        deadline = time.monotonic() + 10
        while engine.replica_status()[0].healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        failed_at = time.monotonic()
        # It runs once its predecessor finished, not from submission (that would fail it ~1 s earlier). The
        # stamp is a done-callback on the delivery thread: it may trail the finish the clock counts from.
        running_from = max(_all_stamped(times, 2).values())
        assert 3.0 - CALLBACK_LAG_S <= failed_at - running_from <= 4.0, failed_at - running_from
        status = engine.replica_status()[0]
        assert not status.healthy and status.failure_reason == "timeout" and status.failed_rank == 0
        assert "past the hang limit of 3.0s" in status.failure and "rank(s) [0, 1] had not replied" in status.failure
        with pytest.raises(EngineUnavailableError, match="timeout"):
            engine.step({"sleep": 0})
