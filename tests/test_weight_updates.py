"""Weight updates are all-or-nothing, on real Ray groups: 2 replicas x TP=2 (CPU, gloo).

`reveal_tp` answers every request with all of its ranks' weights, and each update fills every
tensor with its version number, so a result shows which version computed it and whether the
weights were mixed. Covered: a refused update (wrong shape, unknown name, dtype) changes nothing;
a lease returns an untouched replica and fails a partial one; level-2 sleep needs weights before
waking; buckets are loaded one at a time (peak memory measured); collective_rpc never meets a
weight update or a running control call.

Run: `flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_weight_updates.py -q`
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       EngineUnavailableError, ParallelConfig, ReplicaStateError, WeightSender,
                       WeightUpdateRefusedError)
from tests.plugins.weights import RevealTPEntry, ShardedRevealEntry
from tests.tolerances import BITWISE

pytestmark = pytest.mark.ray
BALLAST = 1024


def _engine(ballast: int = BALLAST, chunks: int = 1, plugin: type = RevealTPEntry) -> Engine:
    args = EngineArgs(plugin=plugin, plugin_args={"ballast": ballast, "chunks": chunks}, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    return Engine(args, DeploymentConfig(mode="local", replica_count=2, cpus_per_rank=0.5))


def _weights(value: float, ballast: int = BALLAST, chunks: int = 1,
             **override: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    named = {"a": torch.full((4,), float(value)), "b": torch.full((4,), float(value))}
    named |= {f"ballast.{i}": torch.full((ballast,), float(value)) for i in range(chunks)}
    return list({**named, **override}.items())


def _assert_serving(engine: Engine, version: int | None, value: float, width: int = 8) -> None:
    """Both replicas SERVING at `version`, and every result (from both) made of weights equal to `value`."""
    status = engine.replica_status()
    assert [(s.state, s.weight_version, s.healthy) for s in status] == [("SERVING", version, True)] * 2
    futures = [engine.submit({}) for _ in range(8)]
    for f in futures:
        torch.testing.assert_close(f.result(timeout=30), torch.full((2, width), float(value)), **BITWISE)
        assert f.weight_version == version
    assert {f.replica for f in futures} == {0, 1}


def _wait_for_states(engine: Engine, states: list[str], within_s: float) -> float:
    """Poll until the replicas are in `states`; returns when that was seen (fails past `within_s`)."""
    deadline = time.monotonic() + within_s
    while [s.state for s in engine.replica_status()] != states:
        assert time.monotonic() < deadline, engine.replica_status()
        time.sleep(0.02)
    return time.monotonic()


def test_a_refused_update_leaves_every_replica_on_its_previous_weights(ray_session):
    with _engine() as engine:
        gloo, store = WeightSender("gloo", timeout_s=60), WeightSender("object_store", timeout_s=60)
        gloo.init_transfer(engine)
        gloo.update(engine, _weights(1), version=1)
        _assert_serving(engine, 1, 1.0)
        bad = [(gloo, _weights(2, b=torch.full((1,), 2.0)), r"'b': shape \[1\], the model's is \[4\]"),
               (store, _weights(2) + [("c", torch.ones(4))], r"'c' is not a weight of the model"),
               (gloo, _weights(2, a=torch.full((4,), 2.0, dtype=torch.float64)),
                r"'a': dtype float64, the model's is float32")]
        for sender, weights, message in bad:
            with pytest.raises(WeightUpdateRefusedError, match=message) as info:
                sender.update(engine, weights, version=2)
            assert "version 2" in str(info.value) and "serves version 1" in str(info.value)
            _assert_serving(engine, 1, 1.0)
        gloo.update(engine, _weights(3), version=3)  # the transfer groups are still in step
        _assert_serving(engine, 3, 3.0)


def test_a_model_with_weight_specs_is_checked_first_and_loads_once_per_bucket(ray_session):
    with _engine(plugin=ShardedRevealEntry) as engine:
        sender = WeightSender("object_store", bucket_bytes=16, timeout_s=60)  # one tensor per bucket
        sender.init_transfer(engine)
        sender.update(engine, _weights(1, chunks=0), version=1)
        _assert_serving(engine, 1, 1.0, width=6)
        assert engine.collective_rpc("load_calls", all_ranks=True) == [[2, 2], [2, 2]]
        with pytest.raises(WeightUpdateRefusedError, match=r"'a': shape \[2\], the model's is \[4\]"):
            sender.update(engine, _weights(2, chunks=0, a=torch.full((2,), 2.0)), version=2)
        _assert_serving(engine, 1, 1.0, width=6)
        assert engine.collective_rpc("load_calls", all_ranks=True) == [[2, 2], [2, 2]]  # nothing reached it


def test_an_expired_lease_returns_an_untouched_replica_and_fails_a_partial_one(ray_session):
    with _engine() as engine:
        sender = WeightSender("object_store", timeout_s=60)
        sender.init_transfer(engine)
        sender.update(engine, _weights(1), version=1)

        started = time.monotonic()  # the trainer vanishes right after start_weight_update
        engine.start_weight_update(5, lease_s=2.0)
        queued = [engine.submit({}) for _ in range(6)]
        with pytest.raises(ReplicaStateError, match=r"no update_weights\(\) completed"):
            engine.finish_weight_update()  # nothing received: refused, and nothing changes
        assert [s.state for s in engine.replica_status()] == ["UPDATING"] * 2
        seen = _wait_for_states(engine, ["SERVING"] * 2, within_s=10)
        assert 2.0 <= seen - started < 5.0
        for f in queued:
            torch.testing.assert_close(f.result(timeout=30), torch.full((2, 8), 1.0), **BITWISE)
            assert f.weight_version == 1
        _assert_serving(engine, 1, 1.0)
        with pytest.raises(ReplicaStateError, match="is SERVING"):
            engine.finish_weight_update()

        engine.start_weight_update(7, lease_s=2.0)  # the trainer vanishes after sending part of it
        sent = time.monotonic()  # the lease runs again from the end of update_weights
        engine.update_weights(sender.prepare([("a", torch.full((4,), 7.0))]))
        queued = [engine.submit({}) for _ in range(6)]
        seen = _wait_for_states(engine, ["FAILED"] * 2, within_s=10)
        assert 2.0 <= seen - sent < 5.0
        for f in queued:  # none of them ever ran on the mixed weights
            with pytest.raises(EngineUnavailableError, match="lease"):
                f.result(timeout=30)
        assert [s.weight_version for s in engine.replica_status()] == [1, 1]


def test_waking_from_level2_sleep_needs_weights_first(ray_session):
    with _engine() as engine:
        sender = WeightSender("object_store", timeout_s=60)
        sender.init_transfer(engine)
        engine.sleep(level=2)
        with pytest.raises(ReplicaStateError, match="load weights first"):
            engine.wake_up()
        assert [(s.state, s.healthy) for s in engine.replica_status()] == [("SLEEPING", True)] * 2
        sender.update(engine, [("a", torch.full((4,), 4.0)), ("b", torch.full((4,), 4.0))], version=4)
        with pytest.raises(ReplicaStateError, match="'ballast.0'"):
            engine.wake_up()  # a partial refill is not enough
        assert [s.state for s in engine.wake_up(tags=["kv_cache"])] == ["SLEEPING"] * 2
        sender.update(engine, _weights(4), version=4)
        assert [r.state for r in engine.wake_up()] == ["SERVING"] * 2
        _assert_serving(engine, 4, 4.0)


def test_an_update_is_loaded_bucket_by_bucket(ray_session):
    ballast, chunks = 1 << 18, 32  # 32 tensors of 1 MiB (float32) on every rank, in 1 MiB buckets
    with _engine(ballast, chunks) as engine:
        sender = WeightSender("gloo", bucket_bytes=1 << 20, timeout_s=120)
        sender.init_transfer(engine)
        before = engine.collective_rpc("reset_peak", all_ranks=True)
        sender.update(engine, _weights(1, ballast, chunks), version=1)
        after = engine.collective_rpc("peak_bytes", all_ranks=True)
        growth = [peak - base for bases, peaks in zip(before, after) for base, peak in zip(bases, peaks)]
        assert len(growth) == 4 and max(growth) < 8 << 20, growth  # a few buckets, not a second 32 MiB copy
        _assert_serving(engine, 1, 1.0)


def test_collective_rpc_is_refused_while_updating_and_waits_for_a_running_control_call(ray_session):
    with _engine() as engine:
        sender = WeightSender("object_store", timeout_s=60)
        sender.init_transfer(engine)
        engine.start_weight_update(2)
        with pytest.raises(ReplicaStateError, match="is UPDATING: collective_rpc"):
            engine.collective_rpc("stamp")
        engine.update_weights(sender.prepare(_weights(2)))
        with pytest.raises(ReplicaStateError, match="is UPDATING: collective_rpc"):
            engine.collective_rpc("stamp", replica=1)
        engine.finish_weight_update()
        _assert_serving(engine, 2, 2.0)

        engine.collective_rpc("set_reset_delay", 1.5)
        with ThreadPoolExecutor(1) as pool:
            resetting = pool.submit(engine.reset_cache)
            time.sleep(0.4)  # the reset hook is running on every rank's control lane by now
            stamps = engine.collective_rpc("stamp", all_ranks=True)
            assert [r.state for r in resetting.result(timeout=30)] == ["SERVING"] * 2
        spans = engine.collective_rpc("control_spans", all_ranks=True)
        for replica_stamps, replica_spans in zip(stamps, spans):
            for stamp, rank_spans in zip(replica_stamps, replica_spans):
                start, end = rank_spans[-1]
                assert not start <= stamp <= end, (start, stamp, end)  # never beside the control call
