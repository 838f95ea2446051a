"""pi0 and pi0.5 on one rank, step by step, against LeRobot 0.4.4's committed chunks; their pure pieces.

Run: `.venv/bin/python -m pytest tests/test_lerobot_pi0.py -q` (inline, no Ray, no LeRobot).

The engine tests (tests/test_lerobot_policy.py) batch frames through the scheduler, where which step
a late frame joins at depends on timing. Here the rank's iteration protocol is driven by hand, so a
frame provably joins while others are half-way: robots 0 and 1 (robot 1 with RTC) start together,
robot 2 is admitted after two expert steps, and each chunk still equals LeRobot's for that robot alone.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry
from phyai_ray.models.lerobot_policy.layers import attend
from phyai_ray.models.lerobot_policy.pi0 import VARIANTS, PiZero, gated, pi_sizes
from phyai_ray.nn.norm import GemmaRMSNorm
from safetensors.torch import load_file, save_file

from tests.test_lerobot_policy import DATA, Cases, args_of
from tests.tolerances import against, reordered

PI_POLICIES = ["pi0", "pi05"]


def rank_of(policy: str):
    entry = LeRobotPolicyEntry(args_of(policy))
    return entry, entry.create({}, SimpleNamespace(device="cpu"))


@pytest.mark.parametrize("policy", PI_POLICIES)
def test_a_frame_joining_half_way_equals_lerobot(policy):
    entry, rank = rank_of(policy)
    cases = Cases(policy)
    rank.admit(0, entry.validate_request(cases.frame(0)))
    rank.admit(1, entry.validate_request(cases.frame(1, rtc=True)))
    done: dict[int, torch.Tensor] = {}
    for _ in range(2):
        assert rank.iterate() == {}
    rank.admit(2, entry.validate_request(cases.frame(2)))
    assert [rank.running[i].index for i in (0, 1, 2)] == [2, 2, 0]  # three robots, two different steps
    while rank.running:
        for ident, delta in rank.iterate().items():
            assert delta.stop_reason == "completed"
            done[ident] = delta.value["actions"]
    assert sorted(done) == [0, 1, 2]
    torch.testing.assert_close(done[0], cases.t["alone"][0], **against("lerobot", "chunks"))
    torch.testing.assert_close(done[1], cases.t["rtc"][1], **against("lerobot", "chunks"))
    torch.testing.assert_close(done[2], cases.t["alone"][2], **against("lerobot", "chunks"))


@pytest.mark.parametrize("policy", PI_POLICIES)
def test_a_dropped_frame_leaves_the_others_exact(policy):
    entry, rank = rank_of(policy)
    cases = Cases(policy)
    for i in range(3):
        rank.admit(i, entry.validate_request(cases.frame(i)))
    rank.iterate()
    rank.drop(1)  # the batch shrinks: the remaining prefixes are stacked anew
    out = {}
    while rank.running:
        out.update({k: d.value["actions"] for k, d in rank.iterate().items()})
    assert sorted(out) == [0, 2]
    for i in (0, 2):
        torch.testing.assert_close(out[i], cases.t["alone"][i], **against("lerobot", "chunks"))


@pytest.mark.parametrize("policy", PI_POLICIES)
def test_the_metadata_names_the_policys_own_step_count(policy):
    entry, _ = rank_of(policy)
    meta = entry.policy_metadata()
    assert meta["type"] == policy
    assert meta["num_steps"] == entry.folder.config["num_inference_steps"] == 5


@pytest.mark.parametrize("policy", PI_POLICIES)
def test_empty_camera_placeholders_are_not_asked_for(tmp_path, policy):
    # LeRobot 0.4.4 saves `empty_cameras: 2` as two more VISUAL features that it feeds as masked -1
    # images; its chunks are the same as without them (checked in its venv: max difference 0.0)
    folder = tmp_path / "pretrained_model"
    shutil.copytree(DATA / policy / "pretrained_model", folder)
    config = json.loads((folder / "config.json").read_text())
    for i in range(2):
        config["input_features"][f"observation.images.empty_camera_{i}"] = {"type": "VISUAL", "shape": [3, 32, 32]}
    (folder / "config.json").write_text(json.dumps({**config, "empty_cameras": 2}))
    entry = LeRobotPolicyEntry({**args_of(policy), "model": str(folder)})
    assert sorted(entry.layout.cameras) == Cases(policy).meta["cameras"]
    rank = entry.create({}, SimpleNamespace(device="cpu"))
    cases = Cases(policy)
    got = rank.step(entry.validate_request(cases.frame(0)))["actions"]
    torch.testing.assert_close(got, cases.t["alone"][0], **against("lerobot", "chunks"))


@pytest.mark.parametrize("policy", PI_POLICIES)
def test_the_tied_embedding_loads_under_either_name(tmp_path, policy):
    # LeRobot saves PaliGemma's token embedding as lm_head.weight (the committed folders); a folder
    # written from the model's own state dict names it embed_tokens: both serve the same chunk
    folder = tmp_path / "pretrained_model"
    shutil.copytree(DATA / policy / "pretrained_model", folder)
    weights = load_file(str(folder / "model.safetensors"))
    prefix = "model.paligemma_with_expert.paligemma."
    weights[prefix + "model.language_model.embed_tokens.weight"] = weights.pop(prefix + "lm_head.weight")
    save_file(weights, str(folder / "model.safetensors"))
    entry = LeRobotPolicyEntry({**args_of(policy), "model": str(folder)})
    rank = entry.create({}, SimpleNamespace(device="cpu"))
    cases = Cases(policy)
    got = rank.step(entry.validate_request(cases.frame(1)))["actions"]
    torch.testing.assert_close(got, cases.t["alone"][1], **against("lerobot", "chunks"))


UNUSED_FULL_SIZE = {  # LeRobot builds them, the chunk never reads them (the prefix keeps only its KV cache)
    "model.paligemma_with_expert.paligemma.model.language_model.norm.weight",
    "model.paligemma_with_expert.paligemma.lm_head.weight",  # tied: the embedding under its other name
    "model.paligemma_with_expert.gemma_expert.lm_head.weight",
}


@pytest.mark.parametrize("policy", PI_POLICIES)
def test_full_size_variants_have_lerobots_shapes(policy):
    # the shapes of LeRobot 0.4.4's 3B pi0 / pi0.5 built on the meta device, per layer folded
    # (scripts/lerobot_reference/full_size_shapes.py); ours built from the same config's variant names
    from scripts.lerobot_reference.full_size_shapes import folded

    ref = json.loads((DATA / "full_size_pi.json").read_text())[policy]
    with torch.device("meta"):
        net = PiZero(ref["config"], None)
    ours = folded({f"model.{k}": list(v.shape) for k, v in net.state_dict().items()})
    theirs = ref["shapes"]
    assert {k: theirs.get(k) for k in ours} == ours
    assert set(theirs) - set(ours) == UNUSED_FULL_SIZE
    assert net.image_tokens() == 256 and net.num_vlm_layers == 18  # 224 / 14 = 16 x 16 patches


def test_pi05_writes_the_state_into_the_prompt_as_256_bins():
    state = torch.tensor([-1.0, -0.999, 0.0, 0.5, 0.99999, 1.0, 3.0, -2.0])
    prompt = PiZero.state_prompt("  pick_up the\ncube ", state)
    # bins of width 2/256 from -1: -1 -> 0, 0 -> 128, 0.5 -> 192, 1 and beyond -> 255, below -1 -> -1
    assert prompt == "Task: pick up the cube, State: 0 0 128 192 255 255 255 -1;\nAction: "


def test_sizes_come_from_the_variant_names_or_are_given_whole():
    sizes = pi_sizes({"paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m"}, None)
    assert sizes["paligemma"] == VARIANTS["gemma_2b"] and sizes["action_expert"]["width"] == 1024
    assert sizes["vocab_size"] == 257152 and sizes["vision"]["patch_size"] == 14
    with pytest.raises(ValueError, match="paligemma_variant='gemma_7b'.*plugin_args\\['sizes'\\]"):
        pi_sizes({"paligemma_variant": "gemma_7b"}, None)
    tiny = Cases("pi0").meta["sizes"]
    assert pi_sizes({}, tiny) is tiny
    broken = {**tiny, "action_expert": {k: v for k, v in tiny["action_expert"].items() if k != "head_dim"}}
    with pytest.raises(ValueError, match="action_expert.*head_dim"):
        pi_sizes({}, broken)
    with pytest.raises(ValueError, match="vocab_size"):
        pi_sizes({}, {k: v for k, v in tiny.items() if k != "vocab_size"})


def test_the_expert_must_share_depth_and_heads_with_paligemma():
    sizes = Cases("pi0").meta["sizes"]
    sizes = {**sizes, "action_expert": {**sizes["action_expert"], "depth": 3}}
    config = {"type": "pi0", "max_action_dim": 8, "max_state_dim": 8, "image_resolution": [32, 32]}
    with torch.device("meta"), pytest.raises(ValueError, match="share depth, num_heads and head_dim"):
        PiZero(config, sizes)


def test_adaptive_rmsnorm_and_the_gated_residual():
    torch.manual_seed(0)
    x, cond = torch.randn(2, 3, 4), torch.randn(2, 6)
    plain = GemmaRMSNorm(4)
    normed, gate = plain(x)
    rms = x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    torch.testing.assert_close(normed, x * rms)  # weight 0 means a scale of 1 (Gemma's 1 + w)
    assert gate is None and torch.equal(gated(x, normed, None), x + normed)
    ada = GemmaRMSNorm(4, cond_dim=6)
    out, gate = ada(x, cond)
    scale, shift, g = ada.dense(cond)[:, None, :].chunk(3, dim=-1)
    torch.testing.assert_close(out, x * rms * (1 + scale) + shift)
    torch.testing.assert_close(gate, g)
    torch.testing.assert_close(gated(x, out, gate), x + out * g)  # the time decides how much a block adds


@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (4, 2), (4, 4)])
def test_grouped_queries_read_their_shared_key_head(heads, kv_heads):
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 5, heads, 8), torch.randn(3, 9, kv_heads, 8), torch.randn(3, 9, kv_heads, 8)
    mask = torch.rand(3, 5, 9) > 0.4
    mask[..., 0] = True
    got = attend(q, k, v, mask)
    rep = heads // kv_heads  # the plain way: every key / value head repeated for its queries
    kr, vr = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q, kr) * 8 ** -0.5
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    want = torch.einsum("bhst,bthd->bshd", probs, vr).reshape(3, 5, heads * 8)
    torch.testing.assert_close(got, want, **reordered(torch.float32, terms=9, depth=2, like=want))


@pytest.mark.parametrize("policy", PI_POLICIES)
def test_a_frames_cost_bounds_its_prefix_cache(policy):
    entry, rank = rank_of(policy)
    cases = Cases(policy)
    payload = entry.validate_request(cases.frame(0))
    [spec] = entry.sequences(payload)
    text = entry.folder.config["tokenizer_max_length"]  # pi0: 16, pi0.5: 48 (the state is in the prompt)
    assert spec.cost == (2 * 16 + text) * 2  # (2 cameras x (32 / 8)^2 patches + prompt) x 2 layers
    rank.admit(0, payload)
    rank.iterate()  # the prefix runs at the iteration after admission (with the plan's other frames)
    prefix = rank.running[0].prefix
    assert 2 * 16 < prefix.length <= 2 * 16 + text
    assert len(prefix.keys) == 2 and prefix.keys[0].shape[0] == prefix.length
