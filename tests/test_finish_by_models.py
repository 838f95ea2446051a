"""Finish-by admission for the diffusion and robot-policy plugins: their sequences say how many
denoising steps they run (`SequenceSpec.steps`), so a request whose deadline is shorter than those
steps x the replica's measured iteration time is answered DeadlineMissedError at once, without
running, and one with enough time runs. Inline engines, no Ray: a tiny random Wan folder
(tests/diffusers_folders.py) and the tiny LeRobot checkpoints of tests/data/lerobot.

Run: `.venv/bin/python -m pytest tests/test_finish_by_models.py -q`
"""

from __future__ import annotations

import time

import pytest

from phyai_ray import DeadlineMissedError, Engine, EngineArgs
from tests.test_lerobot_policy import POLICIES, Cases, args_of


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


def check_finish_by(engine: Engine, request: dict, steps: int) -> dict:
    """Warm the replica (it times its iterations), then: a deadline half of `steps` x the measured
    iteration time is refused at once naming the estimate; a generous one runs. Returns the result."""
    assert engine.step(request) is not None  # the replica now knows how long an iteration takes here
    per_iteration = engine._executors[0].queue.service.estimate()
    assert per_iteration > 0, "no iteration was timed"
    began = time.monotonic()
    hopeless = engine.submit(request, deadline_s=0.5 * steps * per_iteration)
    with pytest.raises(DeadlineMissedError, match=rf"needs {steps} iteration\(s\).*it was not run"):
        hopeless.result(timeout=30)
    assert hopeless.started is None  # never admitted: no iteration of it ran
    assert time.monotonic() - began < 0.5 * steps * per_iteration + 1.0  # answered, not run to the end
    fine = engine.submit(request, deadline_s=30.0 + 4 * steps * per_iteration)
    result = fine.result(timeout=60)
    assert fine.timing()["deadline_met"] is True
    return result


def test_a_video_request_is_admitted_only_if_its_denoising_steps_fit_its_deadline(tmp_path):
    pytest.importorskip("diffusers")
    from tests.diffusers_folders import build_wan

    folder = build_wan(tmp_path / "wan21")
    request = {"prompt": "a robot arm picks up the red cube", "height": 32, "width": 32, "num_frames": 9,
               "max_sequence_length": 16, "num_inference_steps": 12, "guidance_scale": 1.0, "seed": 3,
               "output_type": "latent"}
    plugin = "phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry"
    with Engine(EngineArgs(plugin=plugin, plugin_args={"model": str(folder)})) as engine:
        assert [s.steps for s in engine.entry.sequences(request)] == [12]
        assert check_finish_by(engine, request, 12)["steps"] == 12


@pytest.mark.parametrize("policy", [p for p in ("smolvla", "pi0") if p in POLICIES])
def test_a_robot_frame_is_admitted_only_if_its_expert_steps_fit_its_deadline(policy):
    import phyai_ray.models.lerobot_policy  # noqa: F401  (registers the plugin)
    from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry

    entry = LeRobotPolicyEntry(args_of(policy))
    steps = entry.denoising_steps()
    frame = Cases(policy).frame(0)
    assert [s.steps for s in entry.sequences(frame)] == [steps] and steps >= 2
    with Engine(EngineArgs(plugin="lerobot_policy", plugin_args=args_of(policy))) as engine:
        assert check_finish_by(engine, frame, steps)["actions"].shape[0] > 0
