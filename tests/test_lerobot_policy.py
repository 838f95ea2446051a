"""`lerobot_policy`: LeRobot checkpoints served one action-expert step per iteration, equal to LeRobot.

Run: `.venv/bin/python -m pytest tests/test_lerobot_policy.py -q` (inline, no Ray, no LeRobot).

The reference: tests/data/lerobot/<policy>/ holds a tiny random LeRobot 0.4.4 checkpoint, its tiny
backbone folder, fixed observations and noise, and the chunks LeRobot's predict_action_chunk returned
(`make lerobot-reference` regenerates them in a venv of its own). Shown here, per policy type: each
robot alone, robots batched per expert step at different steps (one joining mid-way), RTC per robot
with its own delay and horizon, all equal to LeRobot's chunks (1e-5); bad folders refused before any
rank starts, naming the file; bad frames refused with the field named while the engine goes on.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import wait
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import phyai_ray.models.lerobot_policy  # noqa: F401  (registers the plugin)
from phyai_ray import Engine, EngineArgs
from phyai_ray.errors import RequestRejectedError
from phyai_ray.models.lerobot_policy.folder import PolicyFolderError
from tests.tolerances import against

DATA = Path(__file__).parent / "data" / "lerobot"
POLICIES = [p for p in ("smolvla", "pi0", "pi05") if (DATA / p / "cases.json").is_file()]


def args_of(policy: str) -> dict:
    root = DATA / policy
    args = {"model": str(root / "pretrained_model")}
    args["vlm" if policy == "smolvla" else "tokenizer"] = str(root / "backbone")
    if policy != "smolvla":  # tiny pi0 / pi0.5: sizes given, as LeRobot's variant names are 2B / 300M
        args["sizes"] = json.loads((root / "cases.json").read_text())["sizes"]
    return args


class Cases:
    def __init__(self, policy: str) -> None:
        root = DATA / policy
        self.t = load_file(str(root / "cases.safetensors"))
        self.meta = json.loads((root / "cases.json").read_text())
        self.n = self.t["noise"].shape[0]

    def frame(self, i: int, rtc: bool = False) -> dict:
        out = {"observation.state": self.t["state"][i], "task": self.meta["prompts"][i], "noise": self.t["noise"][i]}
        for key in self.meta["cameras"]:
            out[key] = self.t[key][i]
        if rtc:
            r = self.meta["rtc"][i]
            out.update(prev_actions=self.t[f"rtc_prev_actions_{i}"], inference_delay=r["inference_delay"],
                       execution_horizon=r["execution_horizon"])
        return out


@pytest.fixture(scope="module", params=POLICIES)
def served(request):
    with Engine(EngineArgs(plugin="lerobot_policy", plugin_args=args_of(request.param))) as engine:
        yield engine, Cases(request.param)


def test_reference_files_exist():
    assert POLICIES, f"no reference files under {DATA}; run `make lerobot-reference`"


def test_each_robot_alone_equals_lerobot(served):
    engine, cases = served
    torch.testing.assert_close(cases.t["batched"], cases.t["alone"], **against("lerobot", "chunks"))  # LeRobot's own batching
    for i in range(cases.n):
        got = engine.step(cases.frame(i))["actions"]
        assert got.shape == cases.t["alone"][i].shape
        torch.testing.assert_close(got, cases.t["alone"][i], **against("lerobot", "chunks"))


def test_robots_batched_per_step_at_different_steps_equal_lerobot(served):
    engine, cases = served
    engine.pause(mode="keep")  # the first robots start together ...
    futures = [engine.submit(cases.frame(i)) for i in range(cases.n - 1)]
    engine.resume()
    futures.append(engine.submit(cases.frame(cases.n - 1)))  # ... the last joins the running batch mid-way
    futures += [engine.submit(cases.frame(i, rtc=True)) for i in range(cases.n)]  # RTC and plain rows mixed
    wait(futures, timeout=120)
    assert max(f.timing()["batch_size"] for f in futures) >= 2
    for i, future in enumerate(futures[:cases.n]):
        torch.testing.assert_close(future.result()["actions"], cases.t["alone"][i], **against("lerobot", "chunks"))
    for i, future in enumerate(futures[cases.n:]):
        torch.testing.assert_close(future.result()["actions"], cases.t["rtc"][i], **against("lerobot", "chunks"))


def test_rtc_per_robot_equals_lerobot(served):
    engine, cases = served
    for i in range(cases.n):
        got = engine.step(cases.frame(i, rtc=True))["actions"]
        torch.testing.assert_close(got, cases.t["rtc"][i], **against("lerobot", "chunks"))
        assert (got - cases.t["alone"][i]).abs().max() > 1e-3  # the guidance changed the chunk


def test_noise_seed_draws_the_noise(served):
    engine, cases = served
    frame = cases.frame(0)
    del frame["noise"]
    a = engine.step({**frame, "noise_seed": 5})["actions"]
    assert torch.equal(a, engine.step({**frame, "noise_seed": 5})["actions"])
    assert (a - engine.step({**frame, "noise_seed": 6})["actions"]).abs().max() > 1e-4


def test_openpi_client_keys_and_uint8_images_map_onto_the_checkpoint(served):
    engine, cases = served
    frame = cases.frame(2)
    top, wrist = cases.meta["cameras"]
    hwc = {k: (frame[k] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy() for k in (top, wrist)}
    openpi = {"observation/image": hwc[top], "observation/wrist_image": hwc[wrist],
              "observation/state": frame["observation.state"].numpy().astype("float64"), "prompt": frame["task"],
              "noise": frame["noise"]}
    lerobot = {**frame, **{k: torch.from_numpy(v).permute(2, 0, 1).float() / 255 for k, v in hwc.items()}}
    torch.testing.assert_close(engine.step(openpi)["actions"], engine.step(lerobot)["actions"], **against("lerobot", "chunks"))
    with pytest.raises(RequestRejectedError, match="twice"):
        engine.step({**openpi, "task": "again"})


BAD_FRAMES = [  # (what is wrong, the words the error must say)
    (lambda f, c: f.pop(c.meta["cameras"][1]), "lacks"),
    (lambda f, c: f.update({"observation.state": torch.zeros(3)}), "observation.state"),
    (lambda f, c: f.update({"noise": torch.zeros(2, 2)}), "noise"),
    (lambda f, c: f.update({"gripper": 1}), "unknown frame keys"),
    (lambda f, c: f.update({c.meta["cameras"][0]: torch.zeros(4, 5)}), "3 dimensions"),
    (lambda f, c: f.update({c.meta["cameras"][0]: torch.zeros(8, 8, 4, dtype=torch.uint8)}), "HWC with 3"),
    (lambda f, c: f.update({"inference_delay": 2}), "inference_delay"),
    (lambda f, c: f.update({"task": 7}), "task"),
]


def test_bad_frames_are_refused_and_the_engine_goes_on(served):
    engine, cases = served
    for change, needle in BAD_FRAMES:
        frame = cases.frame(0)
        change(frame, cases)
        with pytest.raises(RequestRejectedError, match=needle):
            engine.step(frame)
    torch.testing.assert_close(engine.step(cases.frame(1))["actions"], cases.t["alone"][1], **against("lerobot", "chunks"))


def _copy(tmp_path: Path, policy: str) -> Path:
    dst = tmp_path / "pretrained_model"
    shutil.copytree(DATA / policy / "pretrained_model", dst)
    return dst


@pytest.mark.parametrize("policy", POLICIES)
def test_bad_folders_are_refused_before_any_rank_starts(tmp_path, policy):
    def refused(args, needle):
        with pytest.raises((PolicyFolderError, ValueError), match=needle):
            Engine(EngineArgs(plugin="lerobot_policy", plugin_args=args))

    args = args_of(policy)
    refused({**args, "model": "lerobot/smolvla_base"}, "not a local folder")
    folder = _copy(tmp_path, policy)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "type": "act"}))
    refused({**args, "model": str(folder)}, "supported policy types: smolvla, pi0, pi05")
    (folder / "config.json").write_text(json.dumps(config))
    if policy == "smolvla":
        refused({"model": str(folder), "vlm": "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"}, "plugin_args\\['vlm'\\]")
    else:  # the PaliGemma tokenizer the processor names is a hub name: a local folder must be given
        refused({"model": str(folder), "sizes": args["sizes"]}, "plugin_args\\['tokenizer'\\]")
        refused({**args, "sizes": {"vocab_size": 5}}, "sizes")
    weights = load_file(str(folder / "model.safetensors"))
    name = "model.action_in_proj.weight"
    weights[name] = torch.zeros(weights[name].shape[0], weights[name].shape[1] + 1)
    save_file(weights, str(folder / "model.safetensors"))
    refused({**args, "model": str(folder)}, "action_in_proj")
    (folder / "policy_postprocessor.json").unlink()
    refused({**args, "model": str(folder)}, "policy_postprocessor.json")


@pytest.mark.parametrize("policy", POLICIES)
def test_weights_update_by_the_checkpoints_names(policy):
    from types import SimpleNamespace

    from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry

    entry = LeRobotPolicyEntry(args_of(policy))
    rank = entry.create({}, SimpleNamespace(device="cpu"))
    cases = Cases(policy)
    specs = rank.weight_specs()
    saved = load_file(str(DATA / policy / "pretrained_model" / "model.safetensors"))
    stored = set(specs) & set(saved)
    assert len(stored) >= len(specs) - 1 and all(tuple(saved[k].shape) == specs[k][0] for k in stored)
    frame = entry.validate_request(cases.frame(0))
    name = "model.action_out_proj.weight"
    rank.load_weights([(name, saved[name] * 2)])
    assert (rank.step(frame)["actions"] - cases.t["alone"][0]).abs().max() > 1e-3
    rank.load_weights([(name, saved[name])])
    torch.testing.assert_close(rank.step(frame)["actions"], cases.t["alone"][0], **against("lerobot", "chunks"))


def test_the_prefix_cache_goes_through_the_admission_seam():
    from phyai_ray import BatchingConfig
    from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry

    entry = LeRobotPolicyEntry({**args_of("smolvla"), "max_prefix_cache": 1000})
    cases = Cases("smolvla")
    [spec] = entry.sequences(entry.validate_request(cases.frame(0)))
    assert spec.cost == (2 * 4 + 16 + 1) * 4  # (2 cameras x 4 image tokens + 16 prompt + state) x 4 layers
    policy = entry.admission(BatchingConfig())
    assert policy.budget == 1000
    with pytest.raises(ValueError, match="max_prefix_cache"):
        LeRobotPolicyEntry({**args_of("smolvla"), "max_prefix_cache": 0})
