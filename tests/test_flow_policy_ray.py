"""`reference_flow_policy` on a real Ray group (2 rank actors, gloo); its Serve app is tests/test_openpi_fleet.py.

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_flow_policy_ray.py -q

A TP=2 group batched per denoising step gives the single-rank actions (1e-5), RTC frames beside
plain ones; a frame whose deadline passes while the group is held is answered with
DeadlineMissedError without running, and the group serves on.
"""

from __future__ import annotations

from concurrent.futures import wait

import pytest
import torch

from phyai_ray import (DeadlineMissedError, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs,
                       EngineConfig, ParallelConfig, WorkerSupervisorConfig)
from tests.conftest import closed_without_leaks, init_local_ray
from tests.test_flow_policy import ARGS, frame
from tests.tolerances import against

CPU = DeviceConfig(target="cpu")


@pytest.fixture(scope="module")
def alone():
    with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args=ARGS)) as engine:
        yield engine


@pytest.fixture(scope="module")
def tp2():
    init_local_ray()
    engine = Engine(EngineArgs(plugin="reference_flow_policy", plugin_args=ARGS, config=EngineConfig(
        device=CPU, parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2)))),
        DeploymentConfig(mode="local", cpus_per_rank=0.5, process_config=WorkerSupervisorConfig(execution_timeout_s=60)))
    yield from closed_without_leaks(engine)


def test_a_tp2_group_batched_per_step_gives_the_single_rank_actions(tp2, alone):
    frames = [frame(i, rtc=i % 2 == 1) for i in range(16)]
    want = [alone.step(f)["actions"] for f in frames]
    tp2.pause(mode="keep")
    futures = [tp2.submit(f) for f in frames]
    tp2.resume()
    wait(futures, timeout=120)
    assert max(f.timing()["batch_size"] for f in futures) == 16  # one batch per denoising step
    for future, expected in zip(futures, want):
        torch.testing.assert_close(future.result()["actions"], expected, **against("flow_policy", "chunks"))
    for f, out in zip(frames, futures):
        if "prev_actions" in f:
            assert torch.equal(out.result()["actions"][:3], f["prev_actions"][:3])


def test_a_frame_past_its_deadline_on_a_held_group_never_runs(tp2):
    tp2.pause(mode="keep")
    late = tp2.submit(frame(0), deadline_s=0.2)
    with pytest.raises(DeadlineMissedError, match="was not run"):
        late.result(timeout=10)
    tp2.resume()
    assert tp2.step(frame(1), timeout=60)["actions"].shape == (16, 7)
    assert tp2.replica_status()[0].healthy


def test_a_real_group_dispatches_earliest_deadline_first():
    """reference_policy on a TP=2 group, one request per step (max_batch_size 1), held while three
    requests queue: they reach the ranks tight, loose, then the one without a deadline (default_deadline_s=None:
    it sorts by its execution timeout, not 10 s after arrival)."""
    from phyai_ray import BatchingConfig

    engine = Engine(EngineArgs(plugin="reference_policy", config=EngineConfig(
        device=CPU, parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2)))),
        DeploymentConfig(mode="local", cpus_per_rank=0.5,
                         batching=BatchingConfig(max_batch_size=1, default_deadline_s=None),
                         process_config=WorkerSupervisorConfig(execution_timeout_s=60, max_ongoing_requests=1)))
    try:
        engine.step({"state": [0.0] * 8}, timeout=60)
        engine.pause(mode="keep")
        futures = {"none": engine.submit({"state": [0.1] * 8}), "loose": engine.submit({"state": [0.2] * 8}, deadline_s=50),
                   "tight": engine.submit({"state": [0.3] * 8}, deadline_s=20)}
        engine.resume()
        wait(list(futures.values()), timeout=60)
        assert sorted(futures, key=lambda k: futures[k].started) == ["tight", "loose", "none"]
        assert all(f.timing()["deadline_met"] in (True, None) for f in futures.values())
    finally:
        engine.close()  # the module's tp2 fixture checks for leaks once it closes too
