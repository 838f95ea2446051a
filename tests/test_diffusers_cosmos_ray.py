"""Cosmos-Predict2.5 in `diffusers_pipeline` on a real Ray group: CFG over 2 rank actors (gloo).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_diffusers_cosmos_ray.py -q

Cfg rank 0 runs the cond rows and cfg rank 1 the uncond rows of every request, gathered each step;
the dispatcher checks each prompt with the stand-in guardrail and the output rank each video (only it
holds a guardrail). Text-, image- and video-to-world requests of different step counts and guidance
(one without) batched per step equal diffusers' pipeline and one rank (1e-6 of the largest latent);
the decoded video passes the guardrail on the output rank; a refused prompt or video fails alone.
The group lives for the module and is checked for leaks when it closes (`closed_without_leaks`).
"""

from __future__ import annotations

from concurrent.futures import wait

import numpy as np
import pytest
import torch

from phyai_ray import (DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig, OuterParallelConfig,
                       ParallelConfig, WorkerSupervisorConfig)
from tests import diffusers_cosmos as dc
from tests.conftest import closed_without_leaks, init_local_ray
from tests.test_diffusers_cosmos import (PLUGIN, assert_close, engine, folder, pipe,  # noqa: F401
                                         reference, request, wire)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def cfg2(folder):  # noqa: F811

    init_local_ray()
    args = {"model": str(folder), "safety_checker": dc.STAND_IN}
    engine = Engine(EngineArgs(plugin=PLUGIN, plugin_args=args, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(outer=OuterParallelConfig(cfg_size=2)))),
        DeploymentConfig(mode="local", cpus_per_rank=0.5,
                         process_config=WorkerSupervisorConfig(execution_timeout_s=120)))
    yield from closed_without_leaks(engine)


def test_cfg2_equals_the_pipeline_and_one_rank(cfg2, engine, pipe):  # noqa: F811
    requests = [request("text", num_inference_steps=3, seed=31),
                request("image", num_inference_steps=2, guidance_scale=3.0, seed=32),
                request("video", num_inference_steps=4, guidance_scale=1.0, seed=33)]  # cfg rank 1 sends zeros
    cfg2.pause(mode="keep")
    futures = [cfg2.submit(wire(r)) for r in requests]
    cfg2.resume()
    wait(futures, timeout=120)
    assert max(f.timing()["batch_size"] for f in futures) == 3
    for future, r in zip(futures, requests):
        got = torch.as_tensor(future.result()["video"])
        assert_close(got, reference(pipe, r))
        assert_close(got, torch.as_tensor(engine.step(wire(r))["video"]))


def test_cfg2_video_passes_the_guardrail_on_the_output_rank(cfg2, pipe):  # noqa: F811
    r = request("image", num_inference_steps=2, seed=34, output_type="uint8")
    video = torch.as_tensor(cfg2.step(wire(r))["video"])
    want = np.round(reference(pipe, r, output_type="np") * 255).astype(np.uint8)
    np.testing.assert_array_equal(video.numpy(), want)


def test_cfg2_guardrail_refusals_fail_their_request_alone(cfg2, pipe):  # noqa: F811
    """A refused prompt (in the dispatcher) and a refused video (on the output rank) among 3 requests in
    flight: each refusal is a GuardrailError (400) for its request alone, never an EngineUnavailableError;
    the 3 succeed; no error carries the refused prompt; the group serves on."""
    from phyai_ray.errors import EngineUnavailableError, GuardrailError, RequestRejectedError

    secret = f"a {dc.UNSAFE_WORD} scene of a red bus"
    good = [request("text", num_inference_steps=3, seed=41), request("image", num_inference_steps=2, seed=42),
            request("text", num_inference_steps=2, guidance_scale=1.0, seed=43)]
    unsafe_video = request("text", num_inference_steps=1, seed=44, height=dc.UNSAFE_HEIGHT, output_type="uint8")
    cfg2.pause(mode="keep")
    futures = [cfg2.submit(wire(r)) for r in good]
    refused_video = cfg2.submit(wire(unsafe_video))
    with pytest.raises(RequestRejectedError, match="GuardrailError: .* refused the prompt") as prompt_error:
        cfg2.submit(wire(request(prompt=secret, num_inference_steps=1)))  # refused in the dispatcher, at once
    assert GuardrailError in (type(prompt_error.value), type(prompt_error.value.__cause__))
    cfg2.resume()
    wait([*futures, refused_video], timeout=120)
    with pytest.raises(GuardrailError, match="refused the generated video") as video_error:
        refused_video.result()
    for error in (prompt_error.value, video_error.value):
        assert not isinstance(error, EngineUnavailableError) and "red bus" not in str(error)
    for future, r in zip(futures, good):
        assert_close(torch.as_tensor(future.result()["video"]), reference(pipe, r))
    r = request("text", num_inference_steps=1, seed=45)
    assert_close(torch.as_tensor(cfg2.step(wire(r))["video"]), reference(pipe, r))  # the same group serves on
