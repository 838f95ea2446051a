"""`lerobot_policy`'s memory: bfloat16 serving, whole checkpoints as updates, sleep that frees, frame limits.

Run: `.venv/bin/python -m pytest tests/test_lerobot_policy_memory.py -q` (inline, no Ray, no LeRobot).

bfloat16: LeRobot is not installed next to phyai-ray and tests/data/lerobot/ holds its float32 chunks,
so a bfloat16 rank is compared with LeRobot's float32 chunk under a bfloat16-sized tolerance (the
bfloat16 step of ~5-sized actions is 2 ** -6; a chunk of 10 Euler steps through two VLM layers
stays within 1.6 % + 0.05), and it must differ from the float32 chunk (it really ran in bfloat16).
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from phyai_ray import Engine, EngineArgs, WeightSender
from phyai_ray.errors import RequestRejectedError, WeightUpdateRefusedError
from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry
from phyai_ray.models.lerobot_policy.memory import serving_dtype
from phyai_ray.models.lerobot_policy.policy import build_network
from tests.test_lerobot_policy import DATA, POLICIES, Cases, args_of
from tests.tolerances import BITWISE, Tolerance, against

BF16 = Tolerance(1.6e-2, 5e-2, "a policy served in bfloat16 against LeRobot's float32 chunks: bfloat16's own "
                 "rounding (2^-8) over the denoising steps, not a reordering")


def rank_of(args: dict, dtype: str | None = None):
    entry = LeRobotPolicyEntry({**args, **({"dtype": dtype} if dtype else {})})
    return entry, entry.create({}, SimpleNamespace(device="cpu"))


# -- 1. the serving dtype ---------------------------------------------------------------------------

def test_the_default_dtype_is_bfloat16_on_cuda_from_the_checkpoint_and_float32_on_cpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert serving_dtype({}, cuda) == torch.bfloat16  # SmolVLA's config has no dtype field
    assert serving_dtype({"dtype": "float32"}, cuda) == torch.float32  # the checkpoint's own field
    assert serving_dtype({"dtype": "bfloat16"}, cpu) == torch.float32
    assert serving_dtype({}, cpu, "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        LeRobotPolicyEntry({**args_of("smolvla"), "dtype": "int8"})


@pytest.mark.parametrize("policy", POLICIES)
def test_bfloat16_on_cpu_is_lerobot_within_bfloat16_tolerance(policy):
    entry, rank = rank_of(args_of(policy), "bfloat16")
    assert {p.dtype for p in rank.net.parameters()} == {torch.bfloat16}
    cases = Cases(policy)
    n = 2 if policy == "smolvla" else cases.n  # SmolVLA's 512 x 512 cameras cost most in bfloat16 on a CPU
    frames = [entry.validate_request(cases.frame(i)) for i in range(n)]
    for i, frame in enumerate(frames):  # batched per expert step, in the iteration protocol (bfloat16
        rank.admit(i, frame)           # matmuls are slow on CPUs without them: one batch, not each alone)
    done = {}
    while len(done) < len(frames):
        done.update({k: d.value["actions"] for k, d in rank.iterate().items()})
    for i in range(n):
        assert done[i].dtype == torch.float32
        torch.testing.assert_close(done[i], cases.t["alone"][i], **BF16)
        assert not torch.allclose(done[i], cases.t["alone"][i], **against("lerobot", "chunks"))  # it ran in bfloat16


# -- 4. a whole checkpoint as an update -------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_a_whole_checkpoint_is_accepted_as_sent_and_the_report_names_what_was_skipped(policy):
    saved = load_file(str(DATA / policy / "pretrained_model" / "model.safetensors"))
    cases = Cases(policy)
    with Engine(EngineArgs(plugin="lerobot_policy", plugin_args=args_of(policy))) as engine:
        sender = WeightSender("gloo")
        sender.init_transfer(engine)
        bad = [*saved.items(), ("model.no_such_layer.weight", torch.zeros(2)),
               ("model.action_out_proj.weight", torch.zeros(3, 3))]
        with pytest.raises(WeightUpdateRefusedError) as refused:
            sender.update(engine, bad, version=1)
        listed = " ".join(refused.value.problems)
        assert "model.no_such_layer.weight" in listed and "model.action_out_proj.weight" in listed
        assert "lm_head" not in listed
        [report] = sender.update(engine, list(saved.items()), version=2)
        got = engine.step(cases.frame(0))["actions"]
    notes = " | ".join(report.notes)
    skipped = sorted(set(saved) - set(rank_of(args_of(policy))[1].weight_specs()))
    assert skipped and all(name in notes for name in skipped) and "skipped (" in notes
    torch.testing.assert_close(got, cases.t["alone"][0], **against("lerobot", "chunks"))


def test_a_float32_checkpoint_updates_a_bfloat16_rank_by_casting():
    entry, rank = rank_of(args_of("smolvla"), "bfloat16")
    name = "model.action_out_proj.weight"
    assert rank.weight_note(name, tuple(rank.weight_specs()[name][0]), "float32").startswith("cast from float32")
    assert rank.weight_note("model.nope", (2,), "float32") is None
    assert rank.weight_note("model.vlm_with_expert.vlm.lm_head.weight", (3, 3), "float32") is None  # wrong shape


# -- sleep (contract C2) ------------------------------------------------------------------------------

def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status")


@pytest.fixture(scope="module")
def wide_pi0(tmp_path_factory) -> dict:
    """The tiny pi0 folder at widths whose tensors are large enough to measure in RSS (~21 MB), random weights."""
    folder = tmp_path_factory.mktemp("wide") / "pretrained_model"
    shutil.copytree(DATA / "pi0" / "pretrained_model", folder)
    args = {**args_of("pi0"), "model": str(folder)}
    sizes = json.loads(json.dumps(args["sizes"]))
    sizes["paligemma"].update(width=384, mlp_dim=1536)
    sizes["action_expert"].update(width=192, mlp_dim=768)
    sizes["vision"].update(hidden_size=192, intermediate_size=768)
    args["sizes"] = sizes
    from phyai_ray.models.lerobot_policy.folder import PolicyFolder

    torch.manual_seed(0)
    net = build_network(PolicyFolder.open(args), "cpu")
    save_file({f"model.{k}": v.contiguous() for k, v in net.state_dict().items()}, str(folder / "model.safetensors"))
    return args


def test_sleep_2_frees_the_weights_rss_and_an_update_after_waking_serves_the_same_chunks(wide_pi0):
    entry, rank = rank_of(wide_pi0)
    frame = entry.validate_request(Cases("pi0").frame(0))
    before = rank.step(frame)["actions"]
    weights = sum(t.numel() * t.element_size() for t in rank.net.state_dict().values())
    assert weights > 20e6
    gc.collect()
    rss = rss_bytes()
    freed = rank.sleep(2)
    gc.collect()
    assert freed >= weights
    assert rss - rss_bytes() >= 0.85 * weights, (rss, rss_bytes(), weights)
    rank.wake_up(["weights", "kv_cache"])
    saved = load_file(str(Path(wide_pi0["model"]) / "model.safetensors"))
    rank.load_weights(list(saved.items()))
    torch.testing.assert_close(rank.step(frame)["actions"], before, **BITWISE)


def test_sleep_1_on_cpu_frees_the_stacked_prefixes_and_keeps_the_weights():
    entry, rank = rank_of(args_of("smolvla"))
    cases = Cases("smolvla")
    frame = entry.validate_request(cases.frame(0))
    rank.admit(0, frame)
    rank.iterate()
    assert rank.sleep(1) > 0 and rank._stacked is None
    rank.wake_up(["weights"])
    while 0 in rank.running:
        out = rank.iterate()
    torch.testing.assert_close(out[0].value["actions"], cases.t["alone"][0], **against("lerobot", "chunks"))
    assert rank._stacked is None and rank.slots.held_bytes() == 0  # the fleet left: nothing held while idle


# -- limits before the ranks (issue 42, item 3) ---------------------------------------------------------

def test_camera_frames_over_the_limit_are_refused_in_the_dispatcher_naming_the_knob():
    cases = Cases("smolvla")
    top = cases.meta["cameras"][0]
    big = {**cases.frame(0), top: torch.zeros(3, 64, 3000)}
    entry = LeRobotPolicyEntry(args_of("smolvla"))
    with pytest.raises(ValueError, match=r"3000 pixels.*up to 2048 pixels a side \(plugin_args\['max_image_side'\]"):
        entry.validate_request(big)
    with pytest.raises(ValueError, match="'observation.state' must hold"):
        entry.validate_request({**cases.frame(0), "observation.state": torch.zeros(99)})
    with pytest.raises(ValueError, match="3 channels"):
        entry.validate_request({**cases.frame(0), top: torch.zeros(4, 8, 8)})
    wider = LeRobotPolicyEntry({**args_of("smolvla"), "max_image_side": 4096})
    assert wider.validate_request(big).images[top].shape[-1] == 3000
    with Engine(EngineArgs(plugin="lerobot_policy", plugin_args=args_of("smolvla"))) as engine:
        with pytest.raises(RequestRejectedError, match="max_image_side"):
            engine.step(big)
    with pytest.raises(ValueError, match="max_image_side"):
        LeRobotPolicyEntry({**args_of("smolvla"), "max_image_side": 0})


def test_engine_sleep_reports_the_bytes_and_an_update_refills_the_weights():
    saved = load_file(str(DATA / "pi0" / "pretrained_model" / "model.safetensors"))
    cases = Cases("pi0")
    with Engine(EngineArgs(plugin="lerobot_policy", plugin_args=args_of("pi0"))) as engine:
        [report] = engine.sleep(level=2)
        sender = WeightSender("gloo")
        sender.init_transfer(engine)
        sender.update(engine, list(saved.items()), version=3)
        engine.wake_up()
        got = engine.step(cases.frame(0))["actions"]
    [rank] = report.ranks
    skipped = ("lm_head", "language_model.norm")  # not held (the tied embedding's lm_head name: not counted)
    held = sum(t.numel() * t.element_size() for k, t in saved.items() if not any(s in k for s in skipped))
    assert rank["level"] == 2 and rank["freed_bytes"] >= held
    torch.testing.assert_close(got, cases.t["alone"][0], **against("lerobot", "chunks"))
