"""Cosmos3 omni in `diffusers_pipeline` on real Ray groups: TP=2 and CFG=2 over 2 rank actors (gloo).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_diffusers_cosmos3_ray.py -q

Two groups live for the module, each of 2 rank actors at half a CPU: tensor parallel 2 (equal in the
attention and dense domains: each rank holds half the heads and half the MLP units, the row-parallel
sums over gloo) and CFG 2 (cfg rank 0 the cond rows, rank 1 the uncond rows, gathered each step).
On each, a text-to-video request with sound and a policy request (video and action chunk) packed into
the same forwards equal diffusers' `Cosmos3OmniPipeline` to 1e-5. On the TP group a weight update
by the folder's own names (`transformer.layers.0.self_attn.to_q.weight`, split over the ranks by
`shard_of`) changes the output as the same tensor loaded into diffusers does; then sleep(2) drops the
transformer's weights on both ranks, and an update of every `transformer.*` tensor (the engine
refuses to wake a replica whose dropped weights were not loaded since) + wake serves the same
outputs again.
"""

from __future__ import annotations

import pytest
import torch

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, Engine, OuterParallelConfig, ParallelConfig,
                       WeightSender)
from tests.conftest import closed_together, submitted_together
from tests.cosmos3_folders import load_cosmos3_pipeline
from tests.test_diffusers_cosmos3 import action, assert_equal, folder, pipe, reference  # noqa: F401
from tests.test_diffusers_cosmos3 import request as video
from tests.test_diffusers_pipeline_ray import diffusers_group
from tests.tolerances import against

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)

Q = "transformer.layers.0.self_attn.to_q.weight"
TP2 = ParallelConfig(attention=AttentionParallelConfig(tp_size=2), dense=DenseParallelConfig(tp_size=2))


@pytest.fixture(scope="module")
def groups(folder):  # noqa: F811
    cfg2 = ParallelConfig(outer=OuterParallelConfig(cfg_size=2))
    yield from closed_together({"tp2": lambda: diffusers_group(folder, TP2), "cfg2": lambda: diffusers_group(folder, cfg2)})


@pytest.fixture
def tp2(groups):
    return groups["tp2"]


def _packed(engine: Engine, requests: list[dict]) -> list[dict]:
    return [f.result() for f in submitted_together(engine, requests)]


def _served(out: dict) -> dict:
    return {key: torch.as_tensor(out[key]) for key in ("video", "action", "sound") if key in out}


REQUESTS = [video(num_inference_steps=2, seed=21, enable_sound=True), action("policy", seed=22, num_inference_steps=3)]


@pytest.mark.parametrize("layout", ["tp2", "cfg2"])
def test_text_to_video_and_policy_packed_equal_the_pipeline(layout, request, pipe):  # noqa: F811
    engine = request.getfixturevalue("groups")[layout]
    for got, r in zip(_packed(engine, REQUESTS), REQUESTS):
        assert_equal(_served(got), reference(pipe, r), tol=against("diffusers", "batched"))


def test_tp2_update_by_the_folders_names_then_sleep_wake_update_serves_equal(tp2, folder):  # noqa: F811
    fresh = load_cosmos3_pipeline(folder)  # its own copy: the module's `pipe` stays the folder's
    policy = action("policy", seed=23, num_inference_steps=2)
    before = _served(tp2.step(policy))
    with torch.no_grad():
        q = fresh.transformer.layers[0].self_attn.to_q.weight
        q.mul_(1.5).add_(0.01)
    sender = WeightSender("object_store", timeout_s=60)
    sender.init_transfer(tp2)
    sender.update(tp2, [(Q, q.detach().clone())], version=1)
    updated = _served(tp2.step(policy))
    want = reference(fresh, policy)
    assert (updated["action"] - before["action"]).abs().max() > 1e-3  # the update mattered
    assert_equal(updated, want, tol=against("diffusers", "batched"))
    reports = tp2.sleep(level=2)
    assert [r["level"] for report in reports for r in report.ranks] == [2, 2]
    assert all(r["freed_bytes"] > 0 for report in reports for r in report.ranks)
    every = [(f"transformer.{k}", t.detach().clone()) for k, t in fresh.transformer.state_dict().items()]
    sender.update(tp2, every, version=2)  # the dropped weights come back with the update; then wake
    tp2.wake_up()
    again = tp2.step(policy)
    assert again["weight_version"] == 2
    assert_equal(_served(again), want, tol=against("diffusers", "batched"))
    assert_equal(_served(again), updated, tol=against("diffusers", "alone"))
