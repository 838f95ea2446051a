"""RL control plane on real Ray groups (CPU, gloo): states, sleep / wake, weight sync, HYBRID, EngineActor.

Run: `.venv/bin/pytest tests/test_rl.py` (starts one local Ray instance for the session).
"""

from __future__ import annotations

import time
from concurrent.futures import wait

import pytest
import torch

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                       EngineArgs, EngineConfig, EngineUnavailableError, ParallelConfig, PlacementSpec,
                       ReplicaStateError, RequestAbortedError, WeightSender, WorkerSupervisorConfig)
from phyai_ray.models.reference_dit.config import ReferenceDiTConfig
from phyai_ray.nn.weights import full_weights
from tests.plugins.faults import SlowTPEntry
from tests.helpers import wait_until
from tests.plugins.rl import LinearPolicyEntry
from tests.tolerances import reordered

pytestmark = pytest.mark.ray
CPU = DeviceConfig(target="cpu")
REQUEST = {"tokens": [[1, 2, 3, 4], [5, 6, 7, 8]], "labels": [1, 2]}


def tp_vs_one_rank(want: torch.Tensor):
    """reference_dit under TP=2 against one rank: its MLP's 256-term sums (4 blocks, attention and MLP each,
    and the head) are split in two and all-reduced; another order of the same fp32 sums."""
    shape = ReferenceDiTConfig(seed=0)
    return reordered(torch.float32, terms=shape.hidden, depth=2 * shape.layers + 1, like=want)


def _slow(replicas: int = 1, **proc) -> Engine:
    args = EngineArgs(plugin=SlowTPEntry, config=EngineConfig(
        device=CPU, parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    return Engine(args, DeploymentConfig(mode="local", replica_count=replicas, cpus_per_rank=0.5,
                                         process_config=WorkerSupervisorConfig(**proc)))


def _dit(tp: int, replicas: int = 1, mode: str = "auto") -> Engine:
    parallel = (ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
                if tp > 1 else ParallelConfig())
    args = EngineArgs(plugin="reference_dit", plugin_args={"seed": 0},
                      config=EngineConfig(device=CPU, parallel=parallel))
    return Engine(args, DeploymentConfig(mode=mode, replica_count=replicas, cpus_per_rank=0.5))


def _perturbed(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in full_weights(ReferenceDiTConfig(seed=0)).items()}


def test_pause_modes_resume_and_the_queue_waits(ray_session):
    with _slow(execution_timeout_s=60) as engine:
        running = [engine.submit({"sleep": 0.3, "tag": i}) for i in range(4)]
        started = time.monotonic()
        [report] = engine.pause(mode="wait")
        assert report.state == "PAUSED" and report.ranks == (None, None)
        assert time.monotonic() - started < 2.0
        assert sum(f.done() for f in running) >= 2  # the dispatched ones drained; the rest wait queued
        during = [engine.submit({"sleep": 0, "tag": f"p{i}"}) for i in range(3)]
        time.sleep(0.3)
        assert not any(f.done() for f in during) and engine.replica_status()[0].state == "PAUSED"
        engine.resume()
        assert all(torch.equal(f.result(timeout=10), torch.full((2,), 3.0)) for f in running + during)

        queued = [engine.submit({"sleep": 0.2, "tag": f"a{i}"}) for i in range(6)]
        [report] = engine.pause(mode="abort")
        assert report.aborted >= 3
        aborted = [f for f in queued if f.done() and isinstance(f.exception(), RequestAbortedError)]
        assert len(aborted) == report.aborted and "mode='abort'" in str(aborted[0].exception())
        engine.resume()

        queued = [engine.submit({"sleep": 0.5, "tag": f"k{i}"}) for i in range(5)]
        time.sleep(0.05)
        started = time.monotonic()
        engine.pause(mode="keep")
        assert time.monotonic() - started < 0.3  # keep does not wait for the ranks
        engine.resume()
        assert all(f.result(timeout=20) is not None for f in queued)
        status = engine.replica_status()[0]
        assert status.healthy and status.state == "SERVING" and status.in_flight == 0


def test_sleep_wake_idempotent_and_no_step_runs_while_asleep(ray_session):
    args = EngineArgs(plugin=LinearPolicyEntry, config=EngineConfig(device=CPU))
    with Engine(args, DeploymentConfig(mode="local", replica_count=2, cpus_per_rank=0.5)) as engine:
        x = torch.ones(1, 8)
        before = engine.step({"x": x})
        engine.pause()
        reports = engine.sleep(level=1)
        assert [r.state for r in reports] == ["SLEEPING", "SLEEPING"]
        assert engine.sleep(level=1)[0].state == "SLEEPING"  # idempotent
        with pytest.raises(ReplicaStateError, match="is SLEEPING: resume"):
            engine.resume()
        waiting = engine.submit({"x": x, "tag": "asleep"})
        time.sleep(0.3)
        assert not waiting.done()
        assert all("asleep" not in tags for tags in engine.collective_rpc("executed"))
        assert [r.state for r in engine.wake_up(tags=["kv_cache"])] == ["SLEEPING", "SLEEPING"]
        assert [r.state for r in engine.wake_up()] == ["PAUSED", "PAUSED"]
        assert [r.state for r in engine.wake_up()] == ["PAUSED", "PAUSED"]  # idempotent
        engine.resume()
        torch.testing.assert_close(waiting.result(timeout=10), before)


def test_level2_sleep_drops_weights_and_a_weight_update_refills_them(ray_session):
    args = EngineArgs(plugin=LinearPolicyEntry, config=EngineConfig(device=CPU))
    with Engine(args, DeploymentConfig(mode="local", replica_count=1, cpus_per_rank=0.5)) as engine:
        x = torch.ones(1, 8)
        policy = torch.nn.Linear(8, 4)
        engine.sleep(level=2)
        assert engine.collective_rpc("weight_numel", replica=0) == 0
        sender = WeightSender("object_store")
        sender.init_transfer(engine)
        reports = sender.update(engine, [(f"linear.{k}", v) for k, v in policy.state_dict().items()], version=1)
        assert [r.error for r in reports] == [None] and reports[0].state == "SLEEPING"
        engine.wake_up()
        with torch.no_grad():
            torch.testing.assert_close(engine.step({"x": x}), policy(x))


@pytest.mark.parametrize("backend", ["gloo", "object_store"])
def test_four_phase_weight_sync_matches_a_single_rank_model(ray_session, backend):
    new = _perturbed()
    with _dit(tp=1, mode="inline") as single, _dit(tp=2, replicas=2) as engine:
        old = engine.step(REQUEST)
        sender = WeightSender(backend, bucket_bytes=1 << 16)  # several buckets
        assert [r.error for r in sender.init_transfer(engine)] == [None, None]
        reports = sender.update(engine, new.items(), version=11)
        assert [(r.op, r.state, r.weight_version, r.error) for r in reports] == \
            [("finish_weight_update", "SERVING", 11, None)] * 2
        local = WeightSender("gloo")
        local.init_transfer(single)
        local.update(single, new.items(), version=11)
        want = single.step(REQUEST)
        assert not torch.allclose(want, old)
        futures = [engine.submit(REQUEST) for _ in range(4)]
        tol = tp_vs_one_rank(want)
        for f in futures:
            torch.testing.assert_close(f.result(timeout=30), want, **tol)
            assert f.weight_version == 11
        assert {f.replica for f in futures} == {0, 1}
        assert [s.weight_version for s in engine.replica_status()] == [11, 11]


@pytest.mark.parametrize("noticed", [False, True], ids=["in_the_call", "before_the_call"])
def test_a_rank_killed_mid_update_fails_only_its_replica(ray_session, noticed):
    """Whether the death is noticed during update_weights or before it is called, the dead replica
    reports FAILED and the other one finishes its update."""
    import ray

    with _dit(tp=2, replicas=2) as engine:
        sender = WeightSender("object_store")
        sender.init_transfer(engine)
        engine.start_weight_update(3)
        ray.kill(engine._executors[1].ranks.actor(1), no_restart=True)
        if noticed:
            wait_until(lambda: not engine.replica_status()[1].healthy, 10, "replica 1's death noticed")
        reports = engine.update_weights(sender.prepare(_perturbed().items()))
        assert reports[0].error is None
        assert reports[1].state == "FAILED" and reports[1].error
        engine.finish_weight_update(replicas=[0])
        status = engine.replica_status()
        assert (status[0].state, status[0].weight_version) == ("SERVING", 3)
        assert status[1].state == "FAILED" and not status[1].healthy
        futures = [engine.submit(REQUEST) for _ in range(6)]
        assert all(f.result(timeout=30) is not None and f.replica == 0 for f in futures)
        with pytest.raises(EngineUnavailableError):
            engine.pause(replicas=[1])


def test_hybrid_trainer_and_rollout_ranks_share_one_placement_group(ray_session):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0.5)
    class PhyaiTrainer:
        def cycle(self):
            pg = ray.util.get_current_placement_group()
            args = EngineArgs(plugin="reference_dit", plugin_args={"seed": 0}, config=EngineConfig(
                device=CPU, parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2),
                                                    attention=AttentionParallelConfig(tp_size=2))))
            deployment = DeploymentConfig(placement=PlacementSpec(pg, (0, 1)), cpus_per_rank=0.25)
            with Engine(args, deployment) as engine:  # HYBRID: rank 0 shares the trainer's own bundle
                states = [engine.pause()[0].state, engine.sleep(level=1)[0].state]
                sender = WeightSender("object_store")
                sender.init_transfer(engine)
                states.append(sender.update(engine, _perturbed().items(), version=2)[0].state)
                states += [engine.wake_up()[0].state, engine.resume()[0].state]
                future = engine.submit(REQUEST)
                return states, future.result(timeout=30), future.weight_version, engine.replica_status()[0].pids

    pg = placement_group([{"CPU": 1.0}, {"CPU": 1.0}], strategy="PACK", name="phyai-hybrid-test")
    ray.get(pg.ready(), timeout=30)
    try:
        trainer = PhyaiTrainer.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)).remote()
        states, out, version, pids = ray.get(trainer.cycle.remote(), timeout=180)
        assert states == ["PAUSED", "SLEEPING", "SLEEPING", "PAUSED", "SERVING"]
        assert version == 2 and out.shape == (2, 4, 128) and len(pids) == 2
        with _dit(tp=1, mode="inline") as single:
            local = WeightSender("gloo")
            local.init_transfer(single)
            local.update(single, _perturbed().items(), version=2)
            want = single.step(REQUEST)
            torch.testing.assert_close(out, want, **tp_vs_one_rank(want))
        ray.kill(trainer)
    finally:
        remove_placement_group(pg)


def test_engine_actor_control_stays_fast_with_two_thousand_in_flight(ray_session):
    import ray

    from phyai_ray import EngineActor

    @ray.remote(num_cpus=0)
    class PhyaiDriver:
        def run(self, rollout):
            import time as t

            import torch as th

            refs = [rollout.step.remote({"x": th.ones(1, 8), "sleep": 0.006}) for _ in range(2000)]
            deadline = t.monotonic() + 30  # all 2,000 reached the engine: queued or at the ranks
            while sum(s.in_flight + s.served for s in ray.get(rollout.replica_status.remote())) < 2000:
                assert t.monotonic() < deadline
                t.sleep(0.05)
            in_flight = sum(s.in_flight for s in ray.get(rollout.replica_status.remote()))
            timings = {}
            for name, call in (("pause", lambda: rollout.pause.remote(mode="wait")),
                               ("update", None), ("resume", lambda: rollout.resume.remote())):
                started = t.monotonic()
                if call is None:
                    policy = th.nn.Linear(8, 4)
                    sender = WeightSender("object_store")
                    sender.init_transfer(rollout)
                    sender.update(rollout, [(f"linear.{k}", v) for k, v in policy.state_dict().items()], version=5)
                    expected = policy(th.ones(1, 8)).detach()
                else:
                    ray.get(call(), timeout=30)
                timings[name] = t.monotonic() - started
            results = ray.get(refs, timeout=120)
            after = ray.get(rollout.submit.remote({"x": th.ones(1, 8)}), timeout=30)
            return timings, len(results), after, expected, in_flight

    args = EngineArgs(plugin=LinearPolicyEntry, config=EngineConfig(device=CPU))
    rollout = EngineActor.options(num_cpus=0).remote(args, DeploymentConfig(mode="local", replica_count=2,
                                                                            cpus_per_rank=0.5))
    driver = PhyaiDriver.remote()
    try:
        timings, served, after, expected, in_flight = ray.get(driver.run.remote(rollout), timeout=240)
        # most of them still in flight when control runs (how many the groups served while the 2,000 arrived
        # depends on the machine's speed: 1,459 on a slow day of the 2-core VM, above 1,500 on others)
        assert served == 2000 and in_flight >= 1000, in_flight
        assert all(s < 2.0 for s in timings.values()), timings
        assert after.weight_version == 5 and after.replica in (0, 1)
        torch.testing.assert_close(after.value, expected)
    finally:
        ray.kill(driver)
        ray.get(rollout.close.remote(), timeout=60)
        ray.kill(rollout)


def test_an_engine_actor_never_blocks_its_event_loop_on_ray_get(ray_session):
    """Ray warns once per process about any `ray.get` in an asyncio actor: an EngineActor's engine waits on
    its ranks through `ObjectRef.future()` (actors/fetch.py), so start, steps, control and a weight update
    leave Ray's flag unset, while a deliberate `ray.get` in the same process sets it (the check can fail)."""
    import ray

    from phyai_ray import EngineActor

    args = EngineArgs(plugin=LinearPolicyEntry, config=EngineConfig(device=CPU))
    rollout = EngineActor.options(num_cpus=0).remote(args, DeploymentConfig(mode="local", replica_count=1,
                                                                            cpus_per_rank=0.5))

    def warned(_actor):
        import ray._private.worker as worker

        return worker.blocking_get_inside_async_warned

    def blocking_get(_actor):
        import ray as r

        return r.get(r.put(1), timeout=10)

    try:
        ray.get(rollout.step.remote({"x": torch.ones(1, 8)}), timeout=60)
        ray.get(rollout.pause.remote(mode="wait"), timeout=30)
        ray.get(rollout.resume.remote(), timeout=30)
        policy = torch.nn.Linear(8, 4)
        sender = WeightSender("object_store")
        sender.init_transfer(rollout)
        sender.update(rollout, [(f"linear.{k}", v) for k, v in policy.state_dict().items()], version=2)
        after = ray.get(rollout.submit.remote({"x": torch.ones(1, 8)}), timeout=30)
        assert after.weight_version == 2
        assert ray.get(rollout.__ray_call__.remote(warned), timeout=30) is False, \
            "the EngineActor's process called a blocking ray.get"
        assert ray.get(rollout.__ray_call__.remote(blocking_get), timeout=30) == 1
        assert ray.get(rollout.__ray_call__.remote(warned), timeout=30) is True, "the flag never moves: no check"
    finally:
        ray.get(rollout.close.remote(), timeout=60)
        ray.kill(rollout)
