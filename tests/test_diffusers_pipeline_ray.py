"""`diffusers_pipeline` on a real Ray group: CFG over 2 rank actors (gloo), and weight updates by name.

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_diffusers_pipeline_ray.py -q

Cfg rank 0 runs the cond rows and cfg rank 1 the uncond rows of every request, gathered each step:
one request equals WanPipeline (1e-6), requests of different step counts and guidance batched per
step too (1e-5), one without guidance among them. A weight update by diffusers' own names
(`transformer.blocks.0.attn1.to_q.weight`) is checked before anything changes and followed: the
next result equals WanPipeline with the same tensor, and carries the update's version.
"""

from __future__ import annotations

from concurrent.futures import wait

import pytest
import torch

from phyai_ray import (AttentionParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       OuterParallelConfig, ParallelConfig, WeightSender, WeightUpdateRefusedError,
                       WorkerSupervisorConfig)
from tests.conftest import closed_without_leaks, init_local_ray, submitted_together
from tests.test_diffusers_pipeline import BASE, PLUGIN, reference, wan_folders  # noqa: F401
from tests.tolerances import BITWISE, against

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)

Q = "transformer.blocks.0.attn1.to_q.weight"


def diffusers_group(folder, parallel: ParallelConfig) -> Engine:
    """A `diffusers_pipeline` group of the folder on the local Ray, its ranks at half a CPU (gloo)."""
    init_local_ray()
    return Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder)}, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=parallel)),
        DeploymentConfig(mode="local", cpus_per_rank=0.5,
                         process_config=WorkerSupervisorConfig(execution_timeout_s=120)))


@pytest.fixture(scope="module")
def cfg2(wan_folders):  # noqa: F811
    yield from closed_without_leaks(diffusers_group(wan_folders["wan21"],
                                                    ParallelConfig(outer=OuterParallelConfig(cfg_size=2))))


def test_cfg2_equals_wan_pipeline_alone_and_batched_per_step(cfg2, wan_folders):  # noqa: F811
    folder = wan_folders["wan21"]
    alone = {**BASE, "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 5}
    torch.testing.assert_close(cfg2.step({**alone, "output_type": "latent"})["video"], reference(folder, alone),
                               **against("diffusers", "alone"))
    frames = cfg2.step(alone)["video"]  # decoded on the output rank
    assert torch.equal(frames, (reference(folder, alone, "float") * 255).round().to(torch.uint8))
    requests = [{**BASE, "num_inference_steps": 4, "guidance_scale": 5.0, "seed": 1},
                {**BASE, "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 2},  # cfg rank 1 sends zeros
                {**BASE, "prompt": "a dog runs left", "num_inference_steps": 3, "guidance_scale": 2.5, "seed": 3}]
    futures = submitted_together(cfg2, [{**r, "output_type": "latent"} for r in requests])
    for future, request in zip(futures, requests):
        torch.testing.assert_close(future.result()["video"], reference(folder, request), **against("diffusers", "batched"))


def test_a_weight_update_by_diffusers_names_is_checked_then_followed(cfg2, wan_folders):  # noqa: F811
    from diffusers import WanPipeline

    folder = wan_folders["wan21"]
    request = {**BASE, "num_inference_steps": 2, "guidance_scale": 3.0, "seed": 9, "output_type": "latent"}
    before = cfg2.step(request)["video"]
    pipe = WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    new_q = pipe.transformer.blocks[0].attn1.to_q.weight.detach() * 1.5 + 0.01
    sender = WeightSender("object_store", timeout_s=60)
    sender.init_transfer(cfg2)
    with pytest.raises(WeightUpdateRefusedError, match=r"'transformer.blocks.0.attn1.to_q.weight': shape \[24, 2\]"):
        sender.update(cfg2, [(Q, new_q[:, :2].contiguous())], version=1)
    with pytest.raises(WeightUpdateRefusedError, match=r"'transformer.blocks.7.attn1.to_q.weight' is not a weight"):
        sender.update(cfg2, [("transformer.blocks.7.attn1.to_q.weight", new_q)], version=1)
    torch.testing.assert_close(cfg2.step(request)["video"], before, **BITWISE)  # nothing changed
    sender.update(cfg2, [(Q, new_q)], version=2)
    future = cfg2.submit(request)
    got = future.result(timeout=120)
    with torch.no_grad():
        pipe.transformer.blocks[0].attn1.to_q.weight.copy_(new_q)
        kwargs = {k: v for k, v in request.items() if k not in ("seed", "output_type")}
        want = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(9), output_type="latent").frames[0]
    assert (got["video"] - before).abs().max() > 1e-3  # the update mattered
    torch.testing.assert_close(got["video"], want, **against("diffusers", "alone"))
    assert got["weight_version"] == 2


def test_ulysses_over_2_ranks_through_the_step_loop_equals_wan_pipeline(cfg2, wan_folders):  # noqa: F811
    """attention.cp_size=2 on Wan 2.2: every rank holds every request, each forward split over the tokens.
    Closed here; cfg2's leak check at the end of the module finds neither group's actors."""
    folder = wan_folders["wan22"]
    requests = [{**BASE, "num_inference_steps": 3, "guidance_scale": 4.0, "guidance_scale_2": 2.0, "seed": 1},
                {**BASE, "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 2}]
    engine = diffusers_group(folder, ParallelConfig(attention=AttentionParallelConfig(cp_size=2)))
    try:
        futures = [engine.submit({**r, "output_type": "latent"}) for r in requests]
        wait(futures, timeout=120)
        for future, request in zip(futures, requests):
            torch.testing.assert_close(future.result()["video"], reference(folder, request), **against("diffusers", "batched"))
    finally:
        engine.close()
