"""Cosmos-Predict2.5 in `diffusers_pipeline`: the family's step loop against diffusers' own pipeline.

    .venv/bin/python -m pytest tests/test_diffusers_cosmos.py -q

A tiny random folder (tests/diffusers_cosmos.py) is loaded twice: as diffusers'
`Cosmos2_5_PredictBasePipeline` (the reference, with the stand-in guardrail) and as `CosmosFamily`
over the same components. The loop here is the one the per-rank model runs: `start` per request,
`step` over every running request at once, `decode` at the end. Latents must equal the pipeline's to
1e-6 of the largest latent, alone and batched per step with different step counts and guidance.
Clips have 13 frames (4 latent frames): CPU GEMM of fewer than 4 rows (the timestep embedding runs
on one row per latent frame) rounds differently with the batch size, which guidance then amplifies.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from tests import diffusers_cosmos as dc  # noqa: E402

SIZE = dict(height=32, width=32, num_frames=13, max_sequence_length=dc.MAX_SEQUENCE_LENGTH)
RNG = np.random.default_rng(7)
IMAGE = RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8)
VIDEO = RNG.integers(0, 256, (7, 32, 32, 3), dtype=np.uint8)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return dc.write_cosmos_folder(tmp_path_factory.mktemp("cosmos") / "pipeline")


@pytest.fixture(scope="module")
def pipe(folder):
    pipe = dc.load_cosmos_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def family(pipe):
    from phyai_ray.models.diffusers_pipeline.cosmos import CosmosFamily
    from phyai_ray.models.diffusers_pipeline.family import Branches
    from phyai_ray.models.diffusers_pipeline.guardrail import Guardrail

    parts = {name: getattr(pipe, name) for name in ("tokenizer", "text_encoder", "vae", "transformer", "scheduler")}
    parts["safety_checker"] = Guardrail.load(dc.STAND_IN, device="cpu")
    return CosmosFamily(parts, {"_class_name": "Cosmos2_5_PredictBasePipeline"}, Branches(), "cpu", torch.float32)


def request(mode: str = "text", **fields) -> dict:
    r = dict(prompt="a robot arm welds metal", negative_prompt=None, num_inference_steps=3, guidance_scale=7.0,
             seed=1, output_type="latent", image=None, video=None, **SIZE)
    if mode != "text":
        r[mode] = IMAGE if mode == "image" else VIDEO
    r.update(fields)
    return r


def reference(pipe, r: dict, output_type: str = "latent"):
    """diffusers' pipeline for the same request: the latents [C, F, h, w] or the np video [F, H, W, 3]."""
    from PIL import Image

    kwargs = {}
    if r["image"] is not None:
        kwargs["image"] = Image.fromarray(r["image"])
    if r["video"] is not None:
        kwargs["video"] = [Image.fromarray(frame) for frame in r["video"]]
    with torch.no_grad():
        out = pipe(prompt=r["prompt"], negative_prompt=r["negative_prompt"], height=r["height"], width=r["width"],
                   num_frames=r["num_frames"], num_inference_steps=r["num_inference_steps"],
                   guidance_scale=r["guidance_scale"], max_sequence_length=r["max_sequence_length"],
                   generator=torch.Generator("cpu").manual_seed(r["seed"]), output_type=output_type, **kwargs)
    return out.frames[0]


def run(family, requests: list[dict], joins: dict[int, list[dict]] | None = None) -> list:
    """The per-rank loop: every running job takes ONE step per iteration, all in one family.step call;
    `joins[i]` start before iteration i. Returns the jobs in the order they were started."""
    jobs = [family.start(r) for r in requests]
    iteration = 0
    while True:
        for r in (joins or {}).pop(iteration, []):
            jobs.append(family.start(r))
        running = [job for job in jobs if not job.done]
        if not running and not joins:
            return jobs
        if running:
            family.step(running)
        iteration += 1


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-6 * scale, f"max |diff| {err:.3g} > 1e-6 x largest latent {scale:.3g}"


@pytest.mark.parametrize("mode", ["text", "image", "video"])
def test_one_request_equals_pipeline(family, pipe, mode):
    r = request(mode, seed=3)
    [job] = run(family, [r])
    assert job.value.shape == (1, dc.Z_DIM, 4, 4, 4)
    assert_close(job.value[0], reference(pipe, r))


def test_batched_per_step_with_different_step_counts(family, pipe):
    requests = [request("text", num_inference_steps=4, seed=11),
                request("image", num_inference_steps=2, guidance_scale=3.0, seed=12),
                request("video", num_inference_steps=5, guidance_scale=1.0, seed=13),
                request("text", prompt="a red bus moves in the snow", negative_prompt="", num_inference_steps=3,
                        seed=14)]
    late = request("image", num_inference_steps=3, seed=15)
    jobs = run(family, requests, joins={2: [late]})
    for job, r in zip(jobs, requests + [late]):
        assert job.index == r["num_inference_steps"]
        assert_close(job.value[0], reference(pipe, r))


def test_decoded_video_after_the_guardrail_equals_pipeline(family, pipe):
    r = request("image", num_inference_steps=2, seed=5)
    [job] = run(family, [r])
    video = family.decode(job)
    want = reference(pipe, r, output_type="np")
    assert video.shape == (13, 32, 32, 3) and video.dtype == torch.float32
    np.testing.assert_array_equal((video * 255).round().to(torch.uint8).numpy(),
                                  np.round(want * 255).astype(np.uint8))


def test_guardrail_refuses_a_marked_prompt_and_video_without_repeating_them():
    from phyai_ray.errors import RequestRejectedError
    from phyai_ray.models.diffusers_pipeline.guardrail import Guardrail, GuardrailError

    guard = Guardrail.load(dc.STAND_IN, device="cpu")
    assert guard.checker.device == "cpu"  # moved to the model's device
    prompt = f"a {dc.UNSAFE_WORD} video of a red bus"
    with pytest.raises(GuardrailError, match="guardrail .* refused the prompt") as info:
        guard.check_text(prompt)
    assert isinstance(info.value, RequestRejectedError) and dc.UNSAFE_WORD not in str(info.value)
    guard.check_text("a red bus")  # passes
    video = np.zeros((5, dc.UNSAFE_HEIGHT, 32, 3), dtype=np.uint8)
    with pytest.raises(GuardrailError, match="refused the generated video"):
        guard.check_video(video)
    assert guard.check_video(video[:, :32]).shape == (5, 32, 32, 3)


def test_decode_of_a_refused_video_is_a_guardrail_error(family):
    from phyai_ray.models.diffusers_pipeline.guardrail import GuardrailError

    [job] = run(family, [request("text", num_inference_steps=1, seed=6, height=dc.UNSAFE_HEIGHT)])
    with pytest.raises(GuardrailError, match="refused the generated video"):
        family.decode(job)


def test_a_folder_without_guardrail_is_refused(folder):
    from phyai_ray.models.diffusers_pipeline.guardrail import GuardrailConfigError, required_spec, resolve

    with pytest.raises(GuardrailConfigError) as info:
        required_spec({"model": str(folder)}, folder, "Cosmos2_5_PredictBasePipeline")
    message = str(info.value)
    assert "NVIDIA Open Model License" in message and "plugin_args['safety_checker']" in message
    assert "package.module:Name" in message and str(folder) in message
    assert required_spec({"safety_checker": dc.STAND_IN}, folder, "x") == dc.STAND_IN
    for bad in ("tests.diffusers_cosmos", "tests.diffusers_cosmos:Nothing", "tests.diffusers_cosmos:WORDS"):
        with pytest.raises(GuardrailConfigError, match="safety_checker"):
            resolve(bad)


def test_a_guardrail_is_built_offline_unless_a_download_is_asked(monkeypatch):
    import os
    import time

    from phyai_ray.models.diffusers_pipeline.guardrail import Guardrail, GuardrailConfigError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    start = time.monotonic()
    with pytest.raises(GuardrailConfigError, match="safety_checker_download"):
        Guardrail.load("tests.diffusers_cosmos:DownloadingSafetyChecker", {"repo": "nvidia/not-cached-here"})
    assert time.monotonic() - start < 5  # refused at once: no network was tried
    assert "HF_HUB_OFFLINE" not in os.environ  # the offline switch is undone


@pytest.mark.parametrize("fields, rule", [
    (dict(image=IMAGE, video=VIDEO), "not both"),
    (dict(image=IMAGE.astype(np.float32)), "uint8"),
    (dict(video=VIDEO[0]), r"\[frames, H, W, 3\]"),
    (dict(video=VIDEO[:4]), "last 5 frames"),
    (dict(video=VIDEO, num_frames=1), "num_frames >= 5"),
])
def test_bad_conditioning_is_refused_naming_the_rule(fields, rule):
    from phyai_ray.models.diffusers_pipeline.cosmos import check_conditioning

    with pytest.raises(ValueError, match=rule):
        check_conditioning(request(**fields))


def test_torchvision_operations_supplied():
    from phyai_ray.models.diffusers_pipeline.cosmos import _resize, to_tensor

    tensor = to_tensor(IMAGE)
    assert tensor.shape == (3, 32, 32) and tensor.dtype == torch.float32
    assert torch.equal(tensor * 255, torch.from_numpy(IMAGE).permute(2, 0, 1).float())
    mask = torch.arange(16.0).view(1, 1, 4, 4)
    assert torch.equal(_resize(mask, [2, 2]), mask[:, :, ::2, ::2])


# -- through the plugin: Engine(plugin="diffusers_pipeline") inline ---------------------------------------------
PLUGIN = "phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry"


def wire(r: dict) -> dict:
    """The request as a client sends it: no None fields (the plugin fills Cosmos' defaults)."""
    return {k: v for k, v in r.items() if v is not None}


@pytest.fixture(scope="module")
def engine(folder):
    from phyai_ray import Engine, EngineArgs

    args = {"model": str(folder), "safety_checker": dc.STAND_IN}
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args=args)) as engine:
        yield engine


def test_engine_batches_text_image_video_requests_per_step(engine, pipe):
    requests = [request("text", num_inference_steps=4, seed=21), request("image", num_inference_steps=2, seed=22),
                request("video", num_inference_steps=3, guidance_scale=1.0, seed=23)]
    futures = [engine.submit(wire(r)) for r in requests]
    for future, r in zip(futures, requests):
        latents = future.result(timeout=120)["video"]
        assert_close(torch.as_tensor(latents), reference(pipe, r))


def test_engine_video_is_uint8_after_the_guardrail(engine, pipe):
    r = request("video", num_inference_steps=2, seed=24, output_type="uint8")
    video = torch.as_tensor(engine.step(wire(r))["video"])
    want = np.round(reference(pipe, r, output_type="np") * 255).astype(np.uint8)
    assert video.dtype == torch.uint8 and tuple(video.shape) == want.shape
    np.testing.assert_array_equal(video.numpy(), want)


def test_engine_refuses_bad_cosmos_requests_and_serves_on(engine, pipe):
    with pytest.raises(ValueError, match="last 5 frames"):
        engine.step(wire(request(video=VIDEO[:3])))
    with pytest.raises(ValueError, match="4k\\+1"):
        engine.step(wire(request(num_frames=12)))
    r = request("text", num_inference_steps=1, seed=25)
    assert_close(torch.as_tensor(engine.step(wire(r))["video"]), reference(pipe, r))


def test_engine_refuses_a_cosmos_folder_without_guardrail_before_any_rank(folder):
    from phyai_ray import Engine, EngineArgs
    from phyai_ray.models.diffusers_pipeline.guardrail import GuardrailConfigError

    with pytest.raises(GuardrailConfigError, match="licensed") as info:
        Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder)}))
    assert "plugin_args['safety_checker']" in str(info.value) and "'package.module:Name'" in str(info.value)


def test_conditioning_frames_are_refused_for_text_only_pipelines():
    from phyai_ray.models.diffusers_pipeline.request import Limits, VideoRequest, VideoRequestError

    wan = Limits(temporal=4, spatial=8, patch=(1, 2, 2), two_experts=False)
    with pytest.raises(VideoRequestError, match="for Cosmos2_5_PredictBasePipeline folders"):
        VideoRequest.parse({"prompt": "a cube", "height": 32, "width": 32, "image": IMAGE}, wan)
    cosmos = Limits(temporal=4, spatial=8, patch=(1, 2, 2), two_experts=False, conditioning=True)
    parsed = VideoRequest.parse({"prompt": "a cube", "height": 32, "width": 32, "image": IMAGE}, cosmos)
    assert parsed.image is IMAGE and parsed.video is None


def test_engine_refuses_an_unsafe_prompt_once_and_serves_on(engine, pipe):
    from phyai_ray.errors import RequestRejectedError

    before = dict(dc.StandInSafetyChecker.calls)
    with pytest.raises(RequestRejectedError, match="guardrail .* refused the prompt") as info:
        engine.step(wire(request(prompt=f"a {dc.UNSAFE_WORD} robot", num_inference_steps=1)))
    assert dc.UNSAFE_WORD not in str(info.value)
    assert dc.StandInSafetyChecker.calls["text"] == before["text"] + 1  # once, in the dispatcher
    assert dc.StandInSafetyChecker.calls["video"] == before["video"]  # it never reached a rank
    r = request("image", num_inference_steps=1, seed=26)
    assert_close(torch.as_tensor(engine.step(wire(r))["video"]), reference(pipe, r))
