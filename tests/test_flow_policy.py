"""`reference_flow_policy`: a flow-matching action-chunk policy, one denoising step per iteration.

Run: `.venv/bin/pytest tests/test_flow_policy.py -q` (inline, no Ray; TP=2 on Ray is in
tests/test_flow_policy_ray.py).

Shown here: frames batched per denoising step equal each frame alone (1e-5); whole-frame batching
(`per_step=False`) gives the same actions; real-time chunking returns prev_actions[:d] exactly and
brings the guided span closer to prev_actions than the same frame without RTC; bad RTC fields are
refused per frame and the engine goes on.
"""

from __future__ import annotations

from concurrent.futures import wait

import pytest
import torch

from phyai_ray import BatchingConfig, DeploymentConfig, Engine, EngineArgs
from phyai_ray.models.reference_flow_policy.config import RTC
from phyai_ray.stepwise.rtc import Guidance
from tests.tolerances import against

ARGS = {"seed": 3, "num_steps": 10, "horizon": 16, "action_dim": 7, "state_dim": 8}


def frame(i: int, rtc: bool = False, delay: int = 3, k: int = 8) -> dict:
    gen = torch.Generator().manual_seed(100 + i)
    out = {"state": torch.randn(8, generator=gen), "step": i, "noise_seed": 7 + i}
    if rtc:
        out.update(prev_actions=torch.randn(k, 7, generator=gen) * 0.5, inference_delay=delay)
    return out


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args=ARGS)) as engine:
        yield engine


def test_frames_batched_per_denoising_step_equal_each_frame_alone(engine):
    frames = [frame(i, rtc=i % 3 == 0) for i in range(24)]
    alone = [engine.step(f)["actions"] for f in frames]
    engine.pause(mode="keep")  # every frame queued before the first step: they share every iteration
    futures = [engine.submit(f) for f in frames[:12]]
    engine.resume()
    futures += [engine.submit(f) for f in frames[12:]]  # these join the running batch at a later step
    wait(futures, timeout=60)
    sizes = [f.timing()["batch_size"] for f in futures]
    assert max(sizes) >= 12, sizes
    for future, want in zip(futures, alone):
        got = future.result()["actions"]
        assert got.shape == (16, 7)
        torch.testing.assert_close(got, want, **against("flow_policy", "chunks"))
    stats = engine.batch_stats()[0]
    assert stats["batch_size"]["count"] > 0 and stats["running_sequences"] == 0


def test_whole_frame_batching_gives_the_same_actions_as_per_step(engine):
    frames = [frame(i, rtc=i % 2 == 0) for i in range(8)] + [{"state": [0.5] * 8, "step": 3}]  # derived noise seed
    per_step = [engine.step(f)["actions"] for f in frames]
    deployment = DeploymentConfig(batching=BatchingConfig(max_batch_size=8))
    with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args={**ARGS, "per_step": False}),
                deployment) as whole:
        assert not whole.batch_stats()[0].get("running_sequences")  # a step queue, not the iteration loop
        futures = [whole.submit(f) for f in frames]
        for future, want in zip(futures, per_step):
            torch.testing.assert_close(future.result(timeout=60)["actions"], want, **against("flow_policy", "chunks"))


def test_the_same_frame_gives_the_same_actions_and_the_noise_seed_changes_them(engine):
    a, b = engine.step(frame(1))["actions"], engine.step(frame(1))["actions"]
    assert torch.equal(a, b)
    other = engine.step({**frame(1), "noise_seed": 999})["actions"]
    assert (other - a).abs().max() > 1e-2
    derived = engine.step({"state": frame(1)["state"], "step": 1})["actions"]  # seed from the frame itself
    assert torch.equal(derived, engine.step({"state": frame(1)["state"], "step": 1})["actions"])
    assert not torch.equal(derived, engine.step({"state": frame(1)["state"], "step": 2})["actions"])


@pytest.mark.parametrize("delay,k", [(0, 8), (3, 8), (5, 5), (8, 16)])
def test_rtc_returns_the_frozen_prefix_exactly_and_a_smoother_seam(engine, delay, k):
    guided = frame(5, rtc=True, delay=delay, k=k)
    prev = guided["prev_actions"]
    plain = {key: v for key, v in guided.items() if key not in ("prev_actions", "inference_delay")}
    with_rtc, without = engine.step(guided)["actions"], engine.step(plain)["actions"]
    assert torch.equal(with_rtc[:delay], prev[:delay])  # exactly, bit for bit
    span = slice(delay, k)
    if k > delay:
        seam_rtc = (with_rtc[span] - prev[span]).abs().mean()
        seam_plain = (without[span] - prev[span]).abs().mean()
        assert seam_rtc < 0.8 * seam_plain, (seam_rtc, seam_plain)
    if k < 16:  # past prev_actions nothing guides: the actions are the policy's, not the zero padding
        assert with_rtc[k:].abs().mean() > 0.2 * without[k:].abs().mean()


def test_execution_horizon_ends_the_guided_span_early(engine):
    guided = {**frame(9, rtc=True, delay=2, k=12), "execution_horizon": 6}  # guided span: [2, min(12, 6)=6)
    weights = Guidance.build(RTC, guided["prev_actions"], 2, 6, 16, 7).weights[:, 0]
    assert weights[:2].tolist() == [1.0, 1.0] and (weights[2:6] > 0).all() and (weights[6:] == 0).all()
    assert weights[2] > weights[3] > weights[4] > weights[5]  # decaying toward the span's end
    out = engine.step(guided)["actions"]
    assert torch.equal(out[:2], guided["prev_actions"][:2])


@pytest.mark.parametrize("bad,match", [
    ({"prev_actions": torch.zeros(4, 6), "inference_delay": 1}, r"prev_actions.*\[k, 7\]"),
    ({"prev_actions": torch.zeros(20, 7), "inference_delay": 1}, "k <= horizon=16"),
    ({"prev_actions": torch.zeros(4, 7), "inference_delay": 5}, "inference_delay'=5 must be <= k=4"),
    ({"inference_delay": 2}, "inference_delay'=2 must be <= k=0"),
    ({"prev_actions": torch.zeros(4, 7), "inference_delay": -1}, "inference_delay"),
    ({"execution_horizon": 4}, "execution_horizon' needs 'prev_actions"),
    ({"prev_actions": torch.full((4, 7), float("nan")), "inference_delay": 1}, "NaN"),
    ({"noise_seed": "x"}, "noise_seed"),
    ({"speed": 1}, "unknown observation keys"),
])
def test_bad_rtc_fields_are_refused_per_frame_and_the_engine_goes_on(engine, bad, match):
    with pytest.raises(ValueError, match=match):
        engine.submit({"state": torch.zeros(8), **bad})
    assert engine.step(frame(0))["actions"].shape == (16, 7)


def test_a_frame_aborted_between_denoising_steps_fails_with_a_clear_error():
    with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args={**ARGS, "num_steps": 200})) as engine:
        future = engine.submit(frame(0))
        deadline = 0
        while engine.batch_stats()[0]["iterations"] < 2 and deadline < 2000:
            deadline += 1
            wait([future], timeout=0.005)
        engine.pause(mode="abort")
        with pytest.raises(Exception, match="aborted before its last denoising step"):
            future.result(timeout=10)
        engine.resume()
        assert engine.step(frame(1))["actions"].shape == (16, 7)
