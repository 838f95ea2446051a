"""The stepwise room (phyai_ray/stepwise/): the running set of value sequences, RTC with one meaning,
the one robot frame format. Pure, no engine.

Run: `.venv/bin/pytest tests/test_stepwise.py -q`
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from phyai_ray.stepwise.frames import FrameLayout, RobotFrame, openpi_aliases, parse_frame
from phyai_ray.stepwise.policy import StepsInBatches
from phyai_ray.stepwise.rtc import Guidance, RTCRule, prefix_weights
from phyai_ray.stepwise.sequence import Running, Sequence
from tests.tolerances import reordered


def test_running_admits_steps_all_at_once_and_lets_the_finished_ones_out():
    running: Running[Sequence] = Running()
    running.admit(1, Sequence(value=torch.zeros(2), steps=2))
    running.admit(2, Sequence(value=torch.zeros(2), steps=3))
    assert [s.steps for s in running.joined()] == [2, 3] and running.joined() == []
    batches = []

    def advance(batch):
        batches.append(len(batch))
        for seq in batch:
            seq.took(seq.value + 1)

    first = running.iterate(advance, lambda s: s.value.sum().item(), progress=True)
    assert first[1].progress == {"step": 1, "of": 2} and first[1].stop_reason is None
    running.admit(3, Sequence(value=torch.zeros(2), steps=1))  # joins at the next step
    second = running.iterate(advance, lambda s: s.value.sum().item())
    assert batches == [2, 3]
    assert {i: (d.stop_reason, d.value) for i, d in second.items()} == {1: ("completed", 4.0), 3: ("completed", 2.0)}
    assert list(running) == [2] and running[2].index == 2 and running[2].fraction == pytest.approx(2 / 3)
    running.admit(2, Sequence(value=torch.zeros(2), steps=3))  # started again in its place
    assert running[2].index == 0 and running.drop(2) is not None and not running and running.joined() == []


def test_exp_weights_are_physical_intelligences_and_the_span_ends_at_min_s_k():
    w = prefix_weights("EXP", 2, 6, 16)
    c = [(6 - i) / (6 - 2 + 1) for i in range(2, 6)]
    want = [1.0, 1.0] + [ci * (math.exp(ci) - 1) / (math.e - 1) for ci in c] + [0.0] * 10
    torch.testing.assert_close(w, torch.tensor(want), **reordered(torch.float32, terms=2, scale=1.0))  # float64 math
    guide = Guidance.build(RTCRule(), torch.ones(12, 7), delay=2, horizon=6, chunk=16, dim=7)
    assert torch.equal(guide.weights[:, 0], w)
    assert (Guidance.build(RTCRule(), torch.ones(4, 7), 2, None, 16, 7).weights[4:] == 0).all()  # k ends it


def test_the_frozen_prefix_is_prev_actions_exactly_and_lerobots_rule_only_guides_it():
    prev, x0 = torch.randn(5, 3), torch.randn(8, 3)
    for rule in (RTCRule(), RTCRule.lerobot(None)):
        guide, x, n = Guidance.build(rule, prev, 3, None, 8, 3), x0.clone(), 4
        for j in range(n):
            v = -x  # any velocity
            x = x + guide.velocity(x, v, 1 - j / n) / n
            guide.freeze(x, x0, (j + 1) / n)
        assert torch.equal(x[:3], prev[:3]) == rule.frozen_prefix
        assert (x[:3] - prev[:3]).abs().max() < (x0[:3] - prev[:3]).abs().max()  # guided toward it either way
    with pytest.raises(ValueError, match="prefix_attention_schedule"):
        RTCRule.lerobot({"prefix_attention_schedule": "COSINE"})


def test_one_frame_format_for_a_reference_policy_and_a_checkpoint_with_openpis_names():
    ref = FrameLayout(state_dim=4, action_dim=2, chunk=6, aliases=openpi_aliases([], "state"), salt="3")
    frame = parse_frame({"observation/state": np.arange(4.0), "prompt": "go", "step": 2,
                         "prev_actions": [[0.0, 1.0]] * 3, "inference_delay": np.int64(1)}, ref)
    assert frame.task == "go" and frame.inference_delay == 1 and frame.prev_actions.shape == (3, 2)
    assert parse_frame(frame, ref) is frame and frame.noise_seed == parse_frame({"state": [0, 1, 2, 3], "step": 2},
                                                                                 ref).noise_seed
    cams = {"observation.images.top": (3, 8, 8)}
    ckpt = FrameLayout(state_dim=4, action_dim=2, chunk=6, state_key="observation.state", cameras=cams, noise_dim=5,
                       aliases=openpi_aliases(list(cams), "observation.state"))
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    got = parse_frame({"observation/image": image, "observation/state": [1, 2, 3, 4], "noise": torch.zeros(6, 5)}, ckpt)
    assert isinstance(got, RobotFrame) and got.images["observation.images.top"].shape == (3, 8, 8)
    for bad, words in [({"state": [0.0] * 3}, "'state' must hold 4 numbers"), ({"state": [0.0] * 4, "gripper": 1},
                       "unknown frame keys"), ({"state": [0.0] * 4, "execution_horizon": 2}, "needs 'prev_actions'"),
                       ({"state": [0.0] * 4, "prompt": "a", "task": "b"}, "twice")]:
        with pytest.raises(ValueError, match=words):
            parse_frame(bad, ref)
    plain = FrameLayout(state_dim=4, action_dim=2, chunk=6, denoised=False)
    with pytest.raises(ValueError, match="unknown frame keys \\['noise_seed'\\]"):
        parse_frame({"state": [0.0] * 4, "noise_seed": 1}, plain)


def test_steps_in_batches_declares_its_step_batch():
    with pytest.raises(NotImplementedError, match="step_batch"):
        StepsInBatches().step({"state": [0.0]})
