"""`hf_causal_lm` tensor-parallel on a real Ray group (TP=2, gloo) against transformers on one process.

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_hf_causal_lm_ray.py -q

Each architecture runs as one group of two rank actors: heads split over attention_tp (Qwen3 here
with ONE key/value head, replicated on both ranks), MLP over dense_tp, the vocabulary of the
embedding and lm_head split in two (Qwen2 with a tied head and an odd vocabulary, so one shard
is padded). Greedy tokens equal transformers'
`generate`, and log-probs its log_softmax to 1e-4, alone and continuously batched. An update by
transformers' parameter names through the object store reaches both ranks' slices and is
followed token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, Engine, EngineArgs,
                       EngineConfig, ParallelConfig, WeightSender, WorkerSupervisorConfig)
from phyai_ray.config.engine import DeviceConfig
from tests.hf_checkpoints import SHAPE, load_reference, write_checkpoint
from tests.test_hf_causal_lm import PROMPTS, assert_matches, perturbed, reference

pytest.importorskip("transformers")
TOKENS = 10
CASES = {"llama": {}, "qwen2": {"tied": True, "vocab_size": 363},  # an odd vocabulary: rank 1's shard is padded
         "qwen3": {"shape": {**SHAPE, "num_key_value_heads": 1}}, "mistral": {}}


def tp2(folder: Path) -> Engine:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))
    return Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                             config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel)),
                  DeploymentConfig(mode="local", cpus_per_rank=0.5,
                                   process_config=WorkerSupervisorConfig(execution_timeout_s=120)))


@pytest.mark.parametrize("family", sorted(CASES))
def test_tp2_equals_transformers_alone_and_batched(ray_session, tmp_path, family) -> None:
    folder = write_checkpoint(tmp_path / family, family, **CASES[family])
    model = load_reference(folder)
    want = [reference(model, p, TOKENS) for p in PROMPTS]
    with tp2(folder) as engine:
        assert_matches(engine.step({"prompts": [PROMPTS[2]], "max_tokens": TOKENS})[0], want[2])
        futures = [engine.submit({"prompts": [p], "max_tokens": TOKENS}) for p in PROMPTS * 3]
        for future, expected in zip(futures, want * 3):
            assert_matches(future.result(timeout=120)[0], expected)


def test_tp2_follows_an_update_by_transformers_names(ray_session, tmp_path) -> None:
    folder = write_checkpoint(tmp_path / "llama", "llama", shape={**SHAPE, "num_key_value_heads": 4})
    model = load_reference(folder)
    with tp2(folder) as engine:
        before = engine.step({"prompts": [PROMPTS[0]], "max_tokens": TOKENS})[0]
        perturbed(model, seed=2)
        sender = WeightSender("object_store", bucket_bytes=1 << 15)  # several buckets
        sender.init_transfer(engine)
        sender.update(engine, model.named_parameters(), version=7)
        after = engine.step({"prompts": [PROMPTS[0]], "max_tokens": TOKENS})[0]
    assert after.weight_version == 7 and after.token_ids != before.token_ids
    assert_matches(after, reference(model, PROMPTS[0], TOKENS))


def test_affinity_routing_keeps_each_prompts_samples_on_one_replica(ray_session, tmp_path) -> None:
    """GRPO's shape on 2 replicas (Ray, one rank each): 4 prompts x 8 samples sent at once. With
    routing="affinity" every prompt's 8 samples share a replica (so its prefix is computed there once) and
    the prompts spread 2 and 2; with the default routing they scatter over both. Tokens equal either way."""
    folder = write_checkpoint(tmp_path / "qwen2", "qwen2")
    prompts = [[(11 * i + j) % 200 + 3 for j in range(40)] for i in range(4)]
    requests = [{"prompts": [p], "max_tokens": 4} for p in prompts for _ in range(8)]
    placed, tokens = {}, {}
    for routing in ("affinity", "least_loaded"):
        deployment = DeploymentConfig(mode="local", replica_count=2, cpus_per_rank=0.5, routing=routing,
                                      affinity_slack=16)
        with Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                               config=EngineConfig(device=DeviceConfig(target="cpu"))), deployment) as engine:
            futures = [engine.submit(r) for r in requests]
            tokens[routing] = [f.result(timeout=120)[0].token_ids for f in futures]
            placed[routing] = [{futures[8 * i + k].replica for k in range(8)} for i in range(4)]
    assert all(len(replicas) == 1 for replicas in placed["affinity"]), placed
    assert sorted(next(iter(r)) for r in placed["affinity"]) == [0, 0, 1, 1], placed
    assert any(len(replicas) == 2 for replicas in placed["least_loaded"]), placed
    assert tokens["affinity"] == tokens["least_loaded"]
