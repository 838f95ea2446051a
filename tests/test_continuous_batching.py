"""`reference_lm` batched per iteration through the engine: inline and a real Ray group (TP=2, gloo).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_continuous_batching.py -q

The numbers do not depend on what shares the batch: a short request admitted beside a long one
finishes first and both equal their runs alone (greedy tokens; log-probs equal `score()`); a seeded
request samples the same tokens whatever runs beside it. RL control at iteration boundaries:
pause(mode="abort") returns partials that are a prefix of the unpaused result; pause(mode="keep") +
a weight update + resume gives per-token weight versions that change exactly at the update, and
every token's log-prob is `score()` under the weights of its own version (cache_after_update
"recompute"); with "keep" the tokens after the update attend to the old keys and values. 2,000
one-prompt requests through an EngineActor all complete.
"""

from __future__ import annotations

import pytest
import torch

from phyai_ray import (AttentionParallelConfig, BatchingConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig,
                       Engine, EngineArgs, EngineConfig, ParallelConfig, WeightSender, WorkerSupervisorConfig)
from phyai_ray.models.reference_lm import ReferenceLMConfig, full_weights, score
from tests.conftest import closed_without_leaks, init_local_ray
from tests.helpers import wait_until

CPU = DeviceConfig(target="cpu")
LONG, SHORT = [5, 6, 7], [9, 10, 11, 12, 13]
SAMPLED = {"temperature": 0.9, "top_k": 50, "top_p": 0.95}


def lm_engine(tp: int = 1, **batching) -> Engine:
    parallel = (ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
                if tp > 1 else ParallelConfig())
    mode = dict(mode="local", cpus_per_rank=0.5) if tp > 1 else {}
    return Engine(EngineArgs(plugin="reference_lm", plugin_args={"seed": 0},
                             config=EngineConfig(device=CPU, parallel=parallel)),
                  DeploymentConfig(**mode, batching=BatchingConfig(**batching),
                                   process_config=WorkerSupervisorConfig(execution_timeout_s=120)))


@pytest.fixture(scope="module")
def inline_lm():
    with lm_engine() as engine:
        yield engine


@pytest.fixture(scope="module")
def ray_lm():
    init_local_ray()
    engine = lm_engine(tp=2)
    yield from closed_without_leaks(engine)


@pytest.fixture(params=["inline", "ray_tp2"])
def lm(request):
    return request.getfixturevalue("inline_lm" if request.param == "inline" else "ray_lm")


def wait_running(engine: Engine, n: int) -> None:
    wait_until(lambda: engine.batch_stats()[0]["running_sequences"] >= n, 20, f"{n} running sequence(s)",
               interval_s=0.002)


def close_to(got: list[float], want: torch.Tensor, tol: float = 1e-5) -> bool:
    return len(got) == len(want) and (torch.tensor(got) - want).abs().max().item() <= tol


WEIGHTS = full_weights(ReferenceLMConfig(seed=0))


@pytest.mark.ray  # first in the module: the per-test leak check runs before `ray_lm` starts its group
def test_two_thousand_one_prompt_requests_through_an_engine_actor_all_complete(ray_session):
    import ray

    from phyai_ray import EngineActor

    args = EngineArgs(plugin="reference_lm", plugin_args={"seed": 0, "dim": 32, "heads": 2, "layers": 1},
                      config=EngineConfig(device=CPU))
    rollout = EngineActor.options(num_cpus=0).remote(args, DeploymentConfig.local(replica_count=2, cpus_per_rank=0.5))
    try:
        prompts = [[1 + i % 100, 2 + i % 7] for i in range(2000)]
        refs = [rollout.submit.remote({"prompts": [p], "max_tokens": 4, "seed": i}) for i, p in enumerate(prompts)]
        results = ray.get(refs, timeout=300)
        assert len(results) == 2000 and all(len(r.value) == 1 and len(r.value[0].token_ids) == 4 for r in results)
        assert {r.replica for r in results} == {0, 1}
        statuses = ray.get(rollout.replica_status.remote(), timeout=30)
        assert sum(s.served for s in statuses) == 2000 and all(s.in_flight == 0 for s in statuses)
    finally:
        ray.get(rollout.close.remote(), timeout=60)
        ray.kill(rollout)


def test_a_short_request_beside_a_long_one_finishes_first_and_both_equal_their_runs_alone(lm):
    [long_alone] = lm.step({"prompts": [LONG], "max_tokens": 200})
    [short_alone] = lm.step({"prompts": [SHORT], "max_tokens": 4})
    long = lm.submit({"prompts": [LONG], "max_tokens": 200})
    wait_running(lm, 1)
    lm.pause(mode="keep")  # frozen mid-flight, so a starved test thread cannot let it run out meanwhile
    try:
        assert lm.batch_stats()[0]["running_sequences"] == 1 and not long.done()
        later = lm.submit({"prompts": [SHORT], "max_tokens": 4})
    finally:
        lm.resume()  # the short one joins at the next iteration: 5 iterations to the long one's ~190
    [short] = later.result(timeout=60)
    assert not long.done(), "the short request waited for the long one"
    [long_out] = long.result(timeout=60)
    assert short.token_ids == short_alone.token_ids and long_out.token_ids == long_alone.token_ids
    assert close_to(short.log_probs, score(WEIGHTS, SHORT, short.token_ids))
    assert close_to(long_out.log_probs, score(WEIGHTS, LONG, long_out.token_ids))


def test_seeded_sampling_is_the_same_whatever_runs_beside_it(lm):
    request = {"prompts": [SHORT, LONG], "max_tokens": 24, "seed": 11, **SAMPLED}
    alone = lm.step(request)
    beside = [lm.submit({"prompts": [[1 + i, 2 + i]], "max_tokens": 5 + i, "seed": i, **SAMPLED}) for i in range(12)]
    again = lm.submit(request)
    beside += [lm.submit({"prompts": [[3, 4, 5 + i]], "max_tokens": 30}) for i in range(6)]
    assert [o.token_ids for o in again.result(timeout=60)] == [o.token_ids for o in alone]
    assert all(f.result(timeout=60) for f in beside)
    assert close_to(alone[0].log_probs, score(WEIGHTS, SHORT, alone[0].token_ids))


def test_pause_abort_returns_partials_that_are_a_prefix_of_the_unpaused_result(lm):
    request = {"prompts": [LONG, SHORT], "max_tokens": 200}
    full = lm.step(request)
    future = lm.submit(request)
    wait_running(lm, 2)
    lm.pause(mode="abort")
    try:
        partial = future.result(timeout=30)
    finally:
        lm.resume()
    for got, want in zip(partial, full):
        n = len(got.token_ids)
        assert got.stop_reason == "aborted" and 0 < n < 200, (got.stop_reason, n)
        assert got.token_ids == want.token_ids[:n] and got.log_probs == pytest.approx(want.log_probs[:n], abs=1e-5)
    assert lm.step(request)[0].token_ids == full[0].token_ids  # the slots were freed; the replica serves


def test_pause_keep_then_an_update_then_resume_gives_per_token_versions_and_their_log_probs(lm):
    other = full_weights(ReferenceLMConfig(seed=1))
    sender = WeightSender("object_store")
    sender.init_transfer(lm)
    future = lm.submit({"prompts": [LONG], "max_tokens": 200})
    wait_running(lm, 1)
    lm.pause(mode="keep")
    try:
        reports = sender.update(lm, list(other.items()), version=1)
        assert [r.error for r in reports] == [None]
    finally:
        lm.resume()
    [out] = future.result(timeout=60)
    assert 1 in out.weight_versions, out.weight_versions
    switch = out.weight_versions.index(1)
    assert 0 < switch < 200 and set(out.weight_versions[:switch]) == {None} and set(out.weight_versions[switch:]) == {1}
    assert (out.min_weight_version, out.max_weight_version, future.weight_version) == (None, 1, 1)
    assert close_to(out.log_probs[:switch], score(WEIGHTS, LONG, out.token_ids[:switch]))
    assert close_to(out.log_probs[switch:], score(other, LONG, out.token_ids)[switch:])  # recomputed under v1
    sender.update(lm, list(WEIGHTS.items()), version=2)  # the other tests expect the seed-0 weights
    [back] = lm.step({"prompts": [SHORT], "max_tokens": 3})
    assert close_to(back.log_probs, score(WEIGHTS, SHORT, back.token_ids)) and back.weight_versions == [2, 2, 2]


def test_with_cache_after_update_keep_the_tokens_after_an_update_attend_to_the_old_cache():
    other = full_weights(ReferenceLMConfig(seed=1))
    with lm_engine(cache_after_update="keep") as engine:
        sender = WeightSender("object_store")
        sender.init_transfer(engine)
        future = engine.submit({"prompts": [LONG], "max_tokens": 200})
        wait_running(engine, 1)
        engine.pause(mode="keep")
        sender.update(engine, list(other.items()), version=1)
        engine.resume()
        [out] = future.result(timeout=60)
        switch = out.weight_versions.index(1)
        assert 0 < switch < 200
        assert close_to(out.log_probs[:switch], score(WEIGHTS, LONG, out.token_ids[:switch]))
        assert not close_to(out.log_probs[switch:], score(other, LONG, out.token_ids)[switch:], tol=1e-3)
