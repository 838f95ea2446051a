"""`diffusers_pipeline` on WanImageToVideoPipeline folders, inline (no Ray), against diffusers' own pipeline.

Run: `.venv/bin/python -m pytest tests/test_diffusers_wan_i2v.py -q`

Every reference is `WanImageToVideoPipeline.from_pretrained(folder)(image=<PIL image of the same uint8
array>, ..., generator=torch.Generator("cpu").manual_seed(seed), output_type="latent")` in this process
under torch.no_grad(), on the tiny random Wan 2.1 I2V folders of tests/diffusers_folders.py. Shown: one
request alone equals it (latents 1e-6, the float video); requests of different step counts, guidance
and images batched per step (1e-5); first-last-frame folders (`last_image`) alone and batched; the CFG
split's math over two per-rank models without Ray; the image encoded once per request, not per step;
bad requests (no image, a bad image, a video, a misplaced last_image, a text length other than 512)
and bad folders (no image_encoder / image_processor, the Wan 2.2 layouts, no CLIP path) refused naming
the field or file.
"""

from __future__ import annotations

import json
import shutil
import types
from concurrent.futures import wait
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from phyai_ray import AttentionParallelConfig, Engine, EngineArgs, OuterParallelConfig, ParallelConfig
from phyai_ray.errors import ParallelConfigError
from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry
from phyai_ray.models.diffusers_pipeline.folder import PipelineFolderError
from phyai_ray.models.diffusers_pipeline.request import VideoRequestError
from tests.diffusers_folders import build_wan_i2v
from tests.tolerances import against

pytest.importorskip("diffusers")
PLUGIN = "phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry"
BASE = {"prompt": "a robot arm picks up the red cube", "negative_prompt": "blue box", "height": 32, "width": 32,
        "num_frames": 9}


def picture(seed: int, height: int = 40, width: int = 48) -> np.ndarray:
    """A random uint8 [H, W, 3] image (not the request's size: both sides resize it)."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_wan_i2v(tmp_path_factory.mktemp("wan_i2v") / "i2v")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


_PIPES: dict = {}


def reference(folder, request: dict, output_type: str = "latent") -> torch.Tensor:
    """What WanImageToVideoPipeline gives for `request` alone (latents without the batch axis, or the float
    video), its image (and last image) given as PIL images of the request's arrays.

    diffusers' I2V pipeline calls ftfy.fix_text unconditionally (WanPipeline only when ftfy is installed);
    without ftfy it gets the identity, which is what WanPipeline, and so the plugin, applies then."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan_i2v
    from diffusers.utils import is_ftfy_available
    from PIL import Image

    if not is_ftfy_available():
        pipeline_wan_i2v.__dict__.setdefault("ftfy", types.SimpleNamespace(fix_text=lambda text: text))
    if folder not in _PIPES:
        _PIPES[folder] = WanImageToVideoPipeline.from_pretrained(folder)
        _PIPES[folder].set_progress_bar_config(disable=True)
    kwargs = {k: v for k, v in request.items() if k not in ("seed", "output_type", "image", "last_image")}
    if request.get("last_image") is not None:
        kwargs["last_image"] = Image.fromarray(request["last_image"])
    with torch.no_grad():
        out = _PIPES[folder](image=Image.fromarray(request["image"]), **kwargs,
                             generator=torch.Generator("cpu").manual_seed(request.get("seed", 0)),
                             output_type="latent" if output_type == "latent" else "np").frames[0]
    return torch.as_tensor(out)


@pytest.fixture(scope="module")
def engine(folder):
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder)})) as engine:
        yield engine


def test_one_request_alone_equals_the_pipeline(engine, folder):
    request = {**BASE, "image": picture(0), "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 5}
    latents = engine.step({**request, "output_type": "latent"})["video"]
    want = reference(folder, request)
    assert latents.shape == want.shape == (16, 3, 4, 4)
    torch.testing.assert_close(latents, want, **against("diffusers", "alone"))
    video = engine.step({**request, "output_type": "float"})["video"]
    assert video.shape == (9, 32, 32, 3) and video.dtype == torch.float32
    torch.testing.assert_close(video, reference(folder, request, "float"), **against("diffusers", "alone"))
    other = engine.step({**request, "image": picture(1), "output_type": "latent"})["video"]
    assert (other - latents).abs().max() > 1e-3, "the image conditions the video"


def test_requests_batched_per_step_with_their_own_steps_guidance_and_images(engine, folder):
    requests = [{**BASE, "image": picture(1), "num_inference_steps": 4, "guidance_scale": 5.0, "seed": 1},
                {**BASE, "image": picture(2, 32, 32), "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 2},
                {**BASE, "prompt": "a dog runs left", "image": picture(3), "num_inference_steps": 4,
                 "guidance_scale": 3.0, "seed": 3}]  # the 4-step two share one scheduler (a cohort)
    engine.pause(mode="keep")  # all three queued before the first step: they share every iteration
    futures = [engine.submit({**r, "output_type": "latent"}) for r in requests]
    engine.resume()
    wait(futures, timeout=120)
    assert max(f.timing()["batch_size"] for f in futures) == 3
    for future, request in zip(futures, requests):
        result = future.result()
        assert result["steps"] == request["num_inference_steps"]
        torch.testing.assert_close(result["video"], reference(folder, request), **against("diffusers", "batched"))


def test_the_image_is_encoded_once_at_admission_and_a_late_request_joins(folder):
    """The per-rank model alone: B is admitted after A's second step; the CLIP tower and the VAE encoder
    run once per request, never per step; both equal the pipeline."""
    entry = DiffusersPipelineEntry({"model": str(folder)})
    ctx = SimpleNamespace(rank=0, device=torch.device("cpu"), parallel=ParallelConfig(), is_output_rank=True,
                          group_rank=lambda name: 0, group_size=lambda name: 1)
    model = entry.create({"model": str(folder)}, ctx)
    calls = {"image_encoder": 0, "vae": 0}
    for name, method in (("image_encoder", "forward"), ("vae", "encode")):
        module = model.components[name]
        setattr(module, method, _counted(getattr(module, method), calls, name))
    a = {**BASE, "image": picture(4), "num_inference_steps": 5, "seed": 11, "output_type": "latent"}
    b = {**BASE, "image": picture(5), "prompt": "a cat", "num_inference_steps": 3, "guidance_scale": 2.0,
         "seed": 12, "output_type": "latent"}
    model.admit(1, entry.sequences(a)[0].payload)
    for _ in range(2):
        assert model.iterate()[1].stop_reason is None
    model.admit(2, entry.sequences(b)[0].payload)
    done, steps = {}, 0
    while len(done) < 2:
        done.update({k: d.value for k, d in model.iterate().items() if d.stop_reason == "completed"})
        steps += 1
    assert steps == 3 and not model.jobs
    assert calls == {"image_encoder": 2, "vae": 2}, f"{calls} for 2 requests of 5 and 3 steps: once each"
    torch.testing.assert_close(done[1]["video"], reference(folder, a), **against("diffusers", "batched"))
    torch.testing.assert_close(done[2]["video"], reference(folder, b), **against("diffusers", "batched"))


def test_first_last_frame_folders_equal_the_pipeline_alone_and_batched(tmp_path):
    """FLF2V: `last_image` ends the clip and joins the CLIP call; two requests batched per step pair their
    image rows in job order (1e-5), one alone equals the pipeline (1e-6); last_image is required there."""
    flf = build_wan_i2v(tmp_path / "flf2v", first_last=True, seed=1)
    alone = {**BASE, "image": picture(7), "last_image": picture(8, 32, 40), "num_inference_steps": 3,
             "guidance_scale": 4.0, "seed": 9}
    other = {**BASE, "prompt": "a cat", "image": picture(10), "last_image": picture(11), "num_inference_steps": 2,
             "guidance_scale": 1.0, "seed": 10}
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(flf)})) as engine:
        got = engine.step({**alone, "output_type": "latent"})["video"]
        torch.testing.assert_close(got, reference(flf, alone), **against("diffusers", "alone"))
        no_last = engine.step({**alone, "last_image": picture(12), "output_type": "latent"})["video"]
        assert (no_last - got).abs().max() > 1e-3, "the last frame conditions the video"
        engine.pause(mode="keep")
        futures = [engine.submit({**r, "output_type": "latent"}) for r in (alone, other)]
        engine.resume()
        wait(futures, timeout=120)
        assert max(f.timing()["batch_size"] for f in futures) == 2
        for future, request in zip(futures, (alone, other)):
            torch.testing.assert_close(future.result()["video"], reference(flf, request), **against("diffusers", "batched"))
        with pytest.raises(ValueError, match=r"first-last-frame folder .* needs `last_image`"):
            engine.step({**alone, "last_image": None})


def test_cfg_split_over_two_ranks_equals_the_pipeline(folder, monkeypatch):
    """The CFG split's math without Ray: two per-rank models (cfg rank 0 the cond rows, rank 1 the uncond
    rows, zeros for a request without guidance) on two threads, `Branches.gather` an in-process exchange
    in place of the all-gather over group "cfg"; rank 0's latents equal the pipeline's."""
    import threading

    from phyai_ray.models.diffusers_pipeline.family import Branches

    barrier, slots = threading.Barrier(2, timeout=60), {}

    def gather(self, local):
        slots[self.cfg_rank] = local
        slots[("calls", self.cfg_rank)] = slots.get(("calls", self.cfg_rank), 0) + 1
        barrier.wait()
        both = (slots[0], slots[1])
        barrier.wait()
        return both

    monkeypatch.setattr(Branches, "gather", gather)
    entry = DiffusersPipelineEntry({"model": str(folder)})
    requests = [{**BASE, "image": picture(13), "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 21},
                {**BASE, "image": picture(14), "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 22}]
    payloads = [entry.sequences({**r, "output_type": "latent"})[0].payload for r in requests]
    results: dict = {}

    def model_of(cfg_rank: int):  # loaded one after the other: loading is not thread-safe
        ctx = SimpleNamespace(rank=cfg_rank, device=torch.device("cpu"), parallel=ParallelConfig(),
                              is_output_rank=True, group_rank=lambda name: cfg_rank if name == "cfg" else 0,
                              group_size=lambda name: 2 if name == "cfg" else 1)
        return entry.create({"model": str(folder)}, ctx)

    models = [model_of(0), model_of(1)]

    def rank(cfg_rank: int) -> None:
        model = models[cfg_rank]
        for i, payload in enumerate(payloads):
            model.admit(i, payload)
        with torch.no_grad():
            while model.jobs:
                for ident, delta in model.iterate().items():
                    if delta.stop_reason == "completed":
                        results[(cfg_rank, ident)] = delta.value["video"]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == [(0, 0), (0, 1), (1, 0), (1, 1)], f"ranks finished {sorted(results)}"
    assert slots[("calls", 0)] == slots[("calls", 1)] == 3, "one exchange per step: 3 steps, 2 of them shared"
    for ident, request in enumerate(requests):
        torch.testing.assert_close(results[(0, ident)], reference(folder, request), **against("diffusers", "batched"))


def _counted(function, calls: dict, name: str):
    def counted(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)
    return counted


@pytest.mark.parametrize("change, rule", [
    ({"image": None}, r"WanImageToVideoPipeline needs `image`"),
    ({"image": np.zeros((32, 32), np.uint8)}, r"image must be uint8 \[H, W, 3\] \(RGB\), got uint8 \[32, 32\]"),
    ({"image": np.zeros((32, 32, 3), np.float32)}, r"image must be uint8 \[H, W, 3\].*got float32"),
    ({"video": np.zeros((5, 32, 32, 3), np.uint8)}, r"conditions on one `image`; `video` is for Cosmos"),
    ({"max_sequence_length": 16}, r"max_sequence_length=16: .* at 512 text tokens"),
    ({"last_image": np.zeros((32, 32, 3), np.uint8)}, r"last_image needs a first-last-frame folder"),
    ({"num_frames": 10}, r"num_frames=10 breaks the rule num_frames = 4k\+1"),
])
def test_bad_requests_are_refused_naming_the_field_and_the_engine_serves_on(engine, folder, change, rule):
    request = {**BASE, "image": picture(6), "num_inference_steps": 1, "output_type": "latent"}
    with pytest.raises(ValueError, match=rule):  # the engine's RequestRejectedError carries the rule
        engine.step({**request, **change})
    with pytest.raises(VideoRequestError, match=rule):  # and the entry's own check, in the dispatcher
        DiffusersPipelineEntry({"model": str(folder)}).sequences({**request, **change})
    assert engine.step(request)["video"].shape == (16, 3, 4, 4)


def _edited(folder, tmp_path, name, index=None, transformer=None, remove=None):
    target = tmp_path / name
    shutil.copytree(folder, target)
    for file, change in (("model_index.json", index), ("transformer/config.json", transformer)):
        if change:
            data = json.loads((target / file).read_text())
            (target / file).write_text(json.dumps({**data, **change}))
    if remove:
        shutil.rmtree(target / remove)
    return target


@pytest.mark.parametrize("edit, rule", [
    ({"remove": "image_encoder"}, r"model_index.json: WanImageToVideoPipeline needs component 'image_encoder'"),
    ({"remove": "image_processor"}, r"needs component 'image_processor'"),
    ({"index": {"boundary_ratio": 0.9}}, r"model_index.json: WanImageToVideoPipeline with boundary_ratio=0.9"),
    ({"index": {"expand_timesteps": True}}, r"model_index.json: .* expand_timesteps=true .* is not supported"),
    ({"transformer": {"pos_embed_seq_len": 30}}, r"transformer/config.json: pos_embed_seq_len=30 is not 2 x the "
                                                 r"image encoder's 17 tokens"),
])
def test_bad_folders_are_refused_before_any_rank_starts(folder, tmp_path, edit, rule):
    bad = _edited(folder, tmp_path, "bad", **edit)
    with pytest.raises(PipelineFolderError, match=rule):
        DiffusersPipelineEntry({"model": str(bad)})
    with pytest.raises(PipelineFolderError, match=rule):
        Engine(EngineArgs(plugin=PLUGIN, plugin_args={"model": str(bad)}))


def test_a_transformer_without_the_clip_image_path_is_refused(folder, tmp_path):
    """A transformer that takes the 36 channels but no image embeddings (image_dim null) outside the Wan 2.2
    A14B layout (no boundary_ratio / transformer_2): refused naming it; a config that drops image_dim under weights that have it: refused by the tensor check."""
    from diffusers import WanTransformer3DModel

    bad = _edited(folder, tmp_path, "no_clip")
    config = json.loads((bad / "transformer" / "config.json").read_text())
    shutil.rmtree(bad / "transformer")
    plain = {k: v for k, v in config.items() if not k.startswith("_")}
    WanTransformer3DModel(**{**plain, "image_dim": None, "added_kv_proj_dim": None}).save_pretrained(bad / "transformer")
    with pytest.raises(PipelineFolderError, match=r"transformer/config.json: WanImageToVideoPipeline with "
                                                  r"image_dim=null \(a transformer without the CLIP image path\)"):
        DiffusersPipelineEntry({"model": str(bad)})
    lying = _edited(folder, tmp_path, "lying", transformer={"image_dim": None, "added_kv_proj_dim": None})
    with pytest.raises(PipelineFolderError, match=r"tensor 'blocks\.0\.attn2\.add_k_proj\.(weight|bias)' is not a "
                                                  r"parameter of WanTransformer3DModel"):
        DiffusersPipelineEntry({"model": str(lying)})


def test_parallel_layouts_are_the_wan_transformers(folder):
    """CFG, Ulysses and TP as for Wan text-to-video (run in tests/test_diffusers_layouts.py); heads that do not
    divide are refused by the Wan transformer's rules."""
    entry = DiffusersPipelineEntry({"model": str(folder)})
    entry.check_parallel(ParallelConfig(outer=OuterParallelConfig(cfg_size=2)))
    entry.check_parallel(ParallelConfig(attention=AttentionParallelConfig(cp_size=2)))
    with pytest.raises(ParallelConfigError, match="the Wan transformer cannot run .*num_attention_heads=2"):
        entry.check_parallel(ParallelConfig(attention=AttentionParallelConfig(cp_size=4)))
