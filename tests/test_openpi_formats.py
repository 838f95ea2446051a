"""openpi's own clients, unmodified: DROID, ALOHA and LIBERO observations onto a LeRobot checkpoint's keys.

Run: `.venv/bin/python -m pytest tests/test_openpi_formats.py -q` (inline, no Ray).

Each payload is built from the keys openpi's example clients send (examples/droid, aloha_real,
libero: split joint and gripper state, a nested `images` dict of uint8 CHW cameras, uint8 HWC
cameras) holding the same observation as a frame in the checkpoint's own keys; the chunk must be
the same, with the format detected from the keys or named by plugin_args["openpi_format"].
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry
from phyai_ray.stepwise.fields import as_image
from phyai_ray.stepwise.formats import detect
from phyai_ray.stepwise.frames import parse_frame
from tests.test_lerobot_policy import Cases, args_of
from tests.tolerances import BITWISE


@pytest.fixture(scope="module")
def served():
    entry = LeRobotPolicyEntry(args_of("pi0"))
    return entry, entry.create({}, SimpleNamespace(device="cpu")), Cases("pi0")


def observation(cases: Cases) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """Frame 0 with uint8 cameras (as robots send them): the LeRobot-keyed frame, the two HWC cameras, the state."""
    frame = cases.frame(0)
    top, wrist = cases.meta["cameras"]
    hwc = [(frame[k] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy() for k in (top, wrist)]
    lerobot = {**frame, top: hwc[0], wrist: hwc[1]}
    return lerobot, hwc[0], hwc[1], frame["observation.state"].numpy()


def openpi_payloads(cases: Cases) -> dict[str, dict]:
    lerobot, top, wrist, state = observation(cases)
    common = {"prompt": lerobot["task"], "noise": lerobot["noise"]}
    chw = {"cam_high": top.transpose(2, 0, 1), "cam_left_wrist": wrist.transpose(2, 0, 1)}
    return {
        "droid": {"observation/exterior_image_1_left": top, "observation/wrist_image_left": wrist,
                  "observation/joint_position": state[:-1].astype(np.float64),
                  "observation/gripper_position": state[-1:], **common},
        "aloha": {"images": {**chw, "cam_right_wrist": chw["cam_high"], "cam_low": chw["cam_high"]},
                  "state": state, **common},
        "libero": {"observation/image": top, "observation/wrist_image": wrist, "observation/state": state, **common},
    }


@pytest.mark.parametrize("name", ["droid", "aloha", "libero"])
def test_each_openpi_format_gives_the_chunk_of_the_same_frame_in_lerobots_keys(served, name):
    entry, rank, cases = served
    lerobot = observation(cases)[0]
    payload = openpi_payloads(cases)[name]
    assert detect(payload) == name
    want = rank.step(entry.validate_request(lerobot))["actions"]
    got = rank.step(entry.validate_request(payload))["actions"]
    torch.testing.assert_close(got, want, **BITWISE)
    named = parse_frame(payload, replace(entry.layout, openpi_format=name))  # plugin_args["openpi_format"]'s layout
    torch.testing.assert_close(named.state, entry.validate_request(lerobot).state, **BITWISE)


def test_a_named_format_refuses_other_frames_and_unknown_names_are_refused(served):
    entry, _, cases = served
    aloha = LeRobotPolicyEntry({**args_of("pi0"), "openpi_format": "aloha"})
    with pytest.raises(ValueError, match="not in openpi's 'aloha' format"):
        aloha.validate_request(openpi_payloads(cases)["droid"])
    with pytest.raises(ValueError, match="openpi_format"):
        LeRobotPolicyEntry({**args_of("pi0"), "openpi_format": "franka"})
    bad = openpi_payloads(cases)["aloha"]
    bad["images"]["cam_top"] = bad["images"].pop("cam_low")
    with pytest.raises(ValueError, match="unknown cameras \\['cam_top'\\]"):
        entry.validate_request(bad)


def test_images_are_taken_chw_or_hwc_uint8_or_float():
    hwc = torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8)
    want = hwc.permute(2, 0, 1).float() / 255
    for image in (hwc, hwc.permute(2, 0, 1), hwc.float() / 255, hwc.permute(2, 0, 1).float() / 255):
        torch.testing.assert_close(as_image(image, "cam"), want, **BITWISE)
    with pytest.raises(ValueError, match="3 channels"):
        as_image(torch.zeros(4, 5, 6), "cam")
