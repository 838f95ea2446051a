"""`diffusers_pipeline` on Wan folders, inline (no Ray), against diffusers' own WanPipeline.

Run: `.venv/bin/python -m pytest tests/test_diffusers_pipeline.py -q` (CFG over 2 ranks and weight
updates on Ray: tests/test_diffusers_pipeline_ray.py).

Every reference is `WanPipeline.from_pretrained(folder)(..., generator=torch.Generator("cpu").
manual_seed(seed))` in this process under torch.no_grad(), on the tiny random folders of
tests/diffusers_folders.py. Shown: one request alone equals it (latents 1e-6; the float and uint8
videos); requests of different step counts and guidance batched per step (1e-5); a request
admitted while another is half-way; Wan 2.2's two experts and the TI2V layout; bad folders and bad
requests refused naming the rule, the engine serving on; the parallel layouts refused before any
rank starts.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import wait
from types import SimpleNamespace

import pytest
import torch

from phyai_ray import Engine, EngineArgs, OuterParallelConfig, ParallelConfig
from phyai_ray.errors import ParallelConfigError
from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry
from phyai_ray.models.diffusers_pipeline.folder import PipelineFolderError
from phyai_ray.models.diffusers_pipeline.request import VideoRequestError
from tests.diffusers_folders import build_wan
from tests.tolerances import against

pytest.importorskip("diffusers")
PLUGIN = "phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry"
BASE = {"prompt": "a robot arm picks up the red cube", "negative_prompt": "blue box", "height": 32, "width": 32,
        "num_frames": 9, "max_sequence_length": 16}


@pytest.fixture(scope="session")
def wan_folders(tmp_path_factory):
    """{"wan21", "wan22", "ti2v"}: tiny random pipeline folders, built once per test session."""
    root = tmp_path_factory.mktemp("wan")
    return {"wan21": build_wan(root / "wan21"), "wan22": build_wan(root / "wan22", two_experts=True),
            "ti2v": build_wan(root / "ti2v", ti2v=True)}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


_PIPES: dict = {}


def reference(folder, request: dict, output_type: str = "latent") -> torch.Tensor:
    """What WanPipeline gives for `request` alone (latents without the batch axis, or the float video)."""
    from diffusers import WanPipeline

    if folder not in _PIPES:
        _PIPES[folder] = WanPipeline.from_pretrained(folder)
        _PIPES[folder].set_progress_bar_config(disable=True)
    kwargs = {k: v for k, v in request.items() if k not in ("seed", "output_type")}
    with torch.no_grad():
        out = _PIPES[folder](**kwargs, generator=torch.Generator("cpu").manual_seed(request.get("seed", 0)),
                             output_type="latent" if output_type == "latent" else "np").frames[0]
    return torch.as_tensor(out)


@pytest.fixture(scope="module")
def wan21(wan_folders):
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(wan_folders["wan21"])})) as engine:
        yield engine


def test_one_request_alone_equals_wan_pipeline(wan21, wan_folders):
    request = {**BASE, "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 5}
    latents = wan21.step({**request, "output_type": "latent"})["video"]
    want = reference(wan_folders["wan21"], request)
    assert latents.shape == want.shape == (16, 3, 4, 4)
    torch.testing.assert_close(latents, want, **against("diffusers", "alone"))
    video = wan21.step({**request, "output_type": "float"})["video"]
    want_video = reference(wan_folders["wan21"], request, "float")
    assert video.shape == (9, 32, 32, 3) and video.dtype == torch.float32
    torch.testing.assert_close(video, want_video, **against("diffusers", "alone"))
    frames = wan21.step(request)["video"]  # the default: uint8, as diffusers turns its video into images
    assert frames.dtype == torch.uint8 and torch.equal(frames, (want_video * 255).round().to(torch.uint8))


def test_requests_batched_per_step_with_their_own_steps_and_guidance(wan21, wan_folders):
    requests = [{**BASE, "num_inference_steps": 4, "guidance_scale": 5.0, "seed": 1},
                {**BASE, "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 2},  # no guidance: cond rows only
                {**BASE, "prompt": "a dog runs left", "num_inference_steps": 6, "guidance_scale": 3.0, "seed": 3}]
    wan21.pause(mode="keep")  # all three queued before the first step: they share every iteration
    futures = [wan21.submit({**r, "output_type": "latent"}) for r in requests]
    wan21.resume()
    wait(futures, timeout=120)
    assert max(f.timing()["batch_size"] for f in futures) == 3
    for future, request in zip(futures, requests):
        result = future.result()
        assert result["steps"] == request["num_inference_steps"]
        torch.testing.assert_close(result["video"], reference(wan_folders["wan21"], request), **against("diffusers", "batched"))


def test_a_request_admitted_half_way_joins_at_the_next_step(wan_folders):
    """The per-rank model alone: B is admitted after A's second step; both equal WanPipeline."""
    entry = DiffusersPipelineEntry({"model": str(wan_folders["wan21"])})
    ctx = SimpleNamespace(rank=0, device=torch.device("cpu"), parallel=ParallelConfig(), is_output_rank=True,
                          group_rank=lambda name: 0, group_size=lambda name: 1)
    model = entry.create({"model": str(wan_folders["wan21"])}, ctx)
    a = {**BASE, "num_inference_steps": 5, "seed": 11, "output_type": "latent"}
    b = {**BASE, "prompt": "a cat", "num_inference_steps": 3, "guidance_scale": 2.0, "seed": 12,
         "output_type": "latent"}
    model.admit(1, entry.sequences(a)[0].payload)
    for _ in range(2):
        assert model.iterate()[1].stop_reason is None
    model.admit(2, entry.sequences(b)[0].payload)
    done, steps = {}, 0
    while len(done) < 2:
        out = model.iterate()
        steps += 1
        done.update({k: d.value for k, d in out.items() if d.stop_reason == "completed"})
    assert steps == 3 and not model.jobs  # A's last three steps, B's three: together
    torch.testing.assert_close(done[1]["video"], reference(wan_folders["wan21"], a), **against("diffusers", "batched"))
    torch.testing.assert_close(done[2]["video"], reference(wan_folders["wan21"], b), **against("diffusers", "batched"))


def test_requests_with_one_schedule_share_a_scheduler_and_one_may_leave_half_way(wan_folders):
    """Three requests of 4 steps admitted together share ONE scheduler (a cohort, as WanPipeline's
    N-prompt call); one is dropped after two steps and one restarted from its noise: the others go on,
    and every result still equals WanPipeline's for that request alone."""
    entry = DiffusersPipelineEntry({"model": str(wan_folders["wan21"])})
    ctx = SimpleNamespace(rank=0, device=torch.device("cpu"), parallel=ParallelConfig(), is_output_rank=True,
                          group_rank=lambda name: 0, group_size=lambda name: 1)
    model = entry.create({"model": str(wan_folders["wan21"])}, ctx)
    reqs = {i: {**BASE, "prompt": p, "num_inference_steps": 4, "guidance_scale": g, "seed": 20 + i,
                "output_type": "latent"}
            for i, (p, g) in enumerate([("a robot arm", 5.0), ("a dog runs left", 3.0), ("a cat", 5.0)])}
    for i, r in reqs.items():
        model.admit(i, entry.sequences(r)[0].payload)
    model.iterate()
    cohort = model.jobs[0].cohort
    assert cohort is not None and [model.jobs[i].cohort for i in (1, 2)] == [cohort, cohort]
    assert all(model.jobs[i].scheduler is cohort.scheduler for i in range(3)), "one scheduler for the three"
    model.iterate()
    model.drop(1)  # leaves after two of four steps: its rows leave the shared scheduler's state
    assert cohort.jobs == [model.jobs[0], model.jobs[2]]
    model.recompute(2)  # starts again from its noise on a scheduler of its own
    assert model.jobs[2].cohort is None and cohort.jobs == [model.jobs[0]]
    done = {}
    for _ in range(8):
        done.update({k: d.value for k, d in model.iterate().items() if d.stop_reason == "completed"})
    assert sorted(done) == [0, 2] and not model.jobs
    for i in (0, 2):
        torch.testing.assert_close(done[i]["video"], reference(wan_folders["wan21"], reqs[i]), **against("diffusers", "batched"))


def test_wan22_two_experts_and_the_ti2v_layout_equal_wan_pipeline(wan_folders):
    two = {**BASE, "num_inference_steps": 4, "guidance_scale": 4.0, "guidance_scale_2": 2.0, "seed": 7}
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(wan_folders["wan22"])})) as engine:
        got = engine.step({**two, "output_type": "latent"})["video"]
    from diffusers import UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler.from_pretrained(wan_folders["wan22"] / "scheduler")
    scheduler.set_timesteps(4)
    boundary = 0.6 * scheduler.config.num_train_timesteps
    assert (scheduler.timesteps >= boundary).any() and (scheduler.timesteps < boundary).any()  # both experts ran
    torch.testing.assert_close(got, reference(wan_folders["wan22"], two), **against("diffusers", "alone"))
    ti2v = {**BASE, "height": 64, "width": 64, "num_inference_steps": 3, "seed": 4}
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(wan_folders["ti2v"])})) as engine:
        got = engine.step({**ti2v, "output_type": "latent"})["video"]
    assert got.shape == (48, 3, 4, 4)
    torch.testing.assert_close(got, reference(wan_folders["ti2v"], ti2v), **against("diffusers", "alone"))


@pytest.mark.parametrize("request_, rule", [
    ({"num_frames": 10}, r"num_frames=10 breaks the rule num_frames = 4k\+1"),
    ({"height": 40}, r"height a multiple of 16 and width a multiple of 16 \(VAE spatial factor 8 x patch"),
    ({"guidance_scale_2": 2.0}, "guidance_scale_2 is for pipelines with two experts"),
    ({"prompt": ["one", "two"]}, "one text per request"),
    ({"output_type": "pil"}, "output_type='pil' is not one of"),
    ({"steps": 3}, r"unknown request fields \['steps'\]"),
])
def test_bad_requests_are_refused_naming_the_rule_and_the_engine_serves_on(wan21, request_, rule):
    with pytest.raises(ValueError, match=rule):
        wan21.step({**BASE, "num_inference_steps": 1, **request_})
    assert wan21.step({**BASE, "num_inference_steps": 1, "output_type": "latent"})["video"].shape == (16, 3, 4, 4)


def _copy(folder, tmp_path, name):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def test_bad_folders_are_refused_naming_the_file(wan_folders, tmp_path):
    wrong = _copy(wan_folders["wan21"], tmp_path, "wrong")
    index = json.loads((wrong / "model_index.json").read_text())
    (wrong / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    with pytest.raises(PipelineFolderError, match=r"model_index.json: pipeline class 'FluxPipeline' is not "
                                                  r"supported; supported: \[.*'WanPipeline'"):
        DiffusersPipelineEntry({"model": str(wrong)})
    missing = _copy(wan_folders["wan21"], tmp_path, "missing")
    shutil.rmtree(missing / "vae")
    with pytest.raises(PipelineFolderError, match="needs component 'vae'"):
        DiffusersPipelineEntry({"model": str(missing)})
    shapes = _copy(wan_folders["wan21"], tmp_path, "shapes")
    config = json.loads((shapes / "transformer" / "config.json").read_text())
    (shapes / "transformer" / "config.json").write_text(json.dumps({**config, "ffn_dim": 48}))
    rule = r"transformer/diffusion_pytorch_model.safetensors: tensor 'blocks\.0\.ffn\.net\.0\.proj\.(weight|bias)' "
    with pytest.raises(PipelineFolderError, match=rule + r"has shape \[32.*expects \[48"):
        DiffusersPipelineEntry({"model": str(shapes)})
    with pytest.raises(PipelineFolderError, match="model_index.json does not exist"):
        DiffusersPipelineEntry({"model": str(tmp_path / "nowhere")})
    with pytest.raises(PipelineFolderError, match="is not supported"):  # before any rank starts: no engine comes up
        Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(wrong)}))


def test_parallel_layouts_are_checked_before_any_rank_starts(wan_folders):
    from phyai_ray import AttentionParallelConfig

    entry = DiffusersPipelineEntry({"model": str(wan_folders["wan21"])})
    entry.check_parallel(ParallelConfig(outer=OuterParallelConfig(cfg_size=2)))
    entry.check_parallel(ParallelConfig(attention=AttentionParallelConfig(cp_size=2)))
    with pytest.raises(ParallelConfigError, match=r"implements parallel domains .* splits pp=2"):
        entry.check_parallel(ParallelConfig(outer=OuterParallelConfig(pp_size=2)))
    with pytest.raises(ParallelConfigError, match="num_attention_heads=2 is not divisible"):
        entry.check_parallel(ParallelConfig(attention=AttentionParallelConfig(cp_size=4)))


def test_cost_is_latent_tokens_times_guidance_branches(wan_folders):
    entry = DiffusersPipelineEntry({"model": str(wan_folders["wan21"])})
    [guided] = entry.sequences({**BASE, "guidance_scale": 5.0})
    [plain] = entry.sequences({**BASE, "guidance_scale": 1.0})
    assert guided.cost == 2 * 3 * 2 * 2 and plain.cost == 3 * 2 * 2  # 3 latent frames x (4/2) x (4/2) tokens
    with pytest.raises(VideoRequestError, match="4k\\+1"):
        entry.sequences({**BASE, "num_frames": 8})


def test_a_streamed_request_reports_each_step_then_its_video(wan21, wan_folders):
    from phyai_ray.plugins.iteration import Delta

    if "progress" not in Delta.__dataclass_fields__:
        pytest.skip("the iteration loop streams token chunks only: Delta has no `progress` for a value plugin's "
                    "per-step report yet")
    request = {**BASE, "num_inference_steps": 3, "seed": 2, "output_type": "latent"}
    items = list(wan21.stream(request, timeout=120))
    assert items[:3] == [{"step": i, "of": 3} for i in (1, 2, 3)] and len(items) == 4
    torch.testing.assert_close(items[-1]["video"], reference(wan_folders["wan21"], request), **against("diffusers", "alone"))
