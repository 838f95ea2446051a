"""diffusers_pipeline's stages: the encode and the VAE decode run beside the denoising loop, not in it.

One per-rank model (no Ray) over the tiny Wan 2.1 folder: a request's decode runs on the decode
stage's thread while another request keeps stepping (the loop's own records say so), its video
still equals WanPipeline's; a decode or an encode that fails fails that request alone; the decode
stage's VAE views share the VAE's weights, and the tiled one is chosen past `tile_pixels`.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from phyai_ray import ParallelConfig
from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry
from tests.diffusers_folders import build_wan
from tests.tolerances import against

pytest.importorskip("diffusers")
BASE = {"prompt": "a robot arm picks up the red cube", "negative_prompt": "blue box", "height": 32, "width": 32,
        "num_frames": 9, "max_sequence_length": 16, "guidance_scale": 3.0}
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_wan(tmp_path_factory.mktemp("stages") / "wan21")


@pytest.fixture(scope="module")
def entry(folder):
    return DiffusersPipelineEntry({"model": str(folder)})


@pytest.fixture
def model(entry, folder):
    ctx = SimpleNamespace(rank=0, device=torch.device("cpu"), parallel=ParallelConfig(), is_output_rank=True,
                          group_rank=lambda name: 0, group_size=lambda name: 1)
    return entry.create({"model": str(folder)}, ctx)


_PIPES: dict = {}


def reference(folder, request: dict) -> torch.Tensor:
    """WanPipeline's float video [F, H, W, 3] (or latents) for `request` alone."""
    from diffusers import WanPipeline

    if folder not in _PIPES:
        _PIPES[folder] = WanPipeline.from_pretrained(folder)
        _PIPES[folder].set_progress_bar_config(disable=True)
    kwargs = {k: v for k, v in request.items() if k not in ("seed", "output_type")}
    latent = request["output_type"] == "latent"
    with torch.no_grad():
        out = _PIPES[folder](**kwargs, generator=torch.Generator("cpu").manual_seed(request["seed"]),
                             output_type="latent" if latent else "np").frames[0]
    return torch.as_tensor(out)


def run(model, entry, requests: dict[int, dict], limit: int = 400) -> dict:
    """Admit every request, iterate until each has ended; {ident: its last Delta}."""
    for ident, r in requests.items():
        model.admit(ident, entry.sequences(r)[0].payload)
    ended: dict = {}
    for _ in range(limit):
        ended.update({k: d for k, d in model.iterate().items() if d.stop_reason is not None})
        if len(ended) == len(requests):
            return ended
    raise AssertionError(f"only {sorted(ended)} of {sorted(requests)} ended in {limit} iterations")


def slowed(model, seconds: float, fail_seed: int | None = None):
    """The family's decode, slowed by `seconds` (and raising for the request of `fail_seed`)."""
    real = model.family.decode

    def decode(job):
        time.sleep(seconds)
        if job.request["seed"] == fail_seed:
            raise ValueError(f"the decode of seed {fail_seed} failed")
        return real(job)

    model.family.decode = decode


def test_a_decode_runs_on_its_stage_while_the_others_step(model, entry, folder):
    """B's 0.4 s decode runs on the decode stage; A (12 steps) steps through it: no iteration holds the
    decode, A took steps inside its window, and both results equal WanPipeline's."""
    slowed(model, 0.4)
    a = {**BASE, "num_inference_steps": 12, "seed": 1, "output_type": "latent"}
    b = {**BASE, "prompt": "a cat", "num_inference_steps": 2, "seed": 2, "output_type": "float"}
    ended = run(model, entry, {1: a, 2: b})
    log = list(model.stages.log)
    [(_, ident, thread, d0, d1)] = [entry_ for entry_ in log if entry_[0] == "decode"]
    loop = threading.current_thread().name
    iterations = [(t0, t1) for what, _, name, t0, t1 in log if what == "iterate"]
    assert ident == 2 and thread.startswith("phyai-decode") and thread != loop
    assert {name for what, _, name, _, _ in log if what == "iterate"} == {loop}
    assert not any(t0 <= d0 and d1 <= t1 for t0, t1 in iterations), "an iteration waited out the decode"
    inside = [(t0, t1) for t0, t1 in iterations if d0 <= t0 and t1 <= d1]
    assert len(inside) >= 2, f"A stepped {len(inside)} time(s) during B's decode"
    assert [ended[k].stop_reason for k in (1, 2)] == ["completed", "completed"]
    torch.testing.assert_close(ended[1].value["video"], reference(folder, a), **against("diffusers", "batched"))
    torch.testing.assert_close(ended[2].value["video"], reference(folder, b), **against("diffusers", "batched"))


def test_a_failed_decode_fails_that_request_alone(model, entry, folder):
    slowed(model, 0.0, fail_seed=4)
    reqs = {1: {**BASE, "num_inference_steps": 3, "seed": 3, "output_type": "float"},
            2: {**BASE, "prompt": "a cat", "num_inference_steps": 2, "seed": 4, "output_type": "float"}}
    ended = run(model, entry, reqs)
    assert ended[2].stop_reason == "error" and isinstance(ended[2].error, ValueError)
    assert "seed 4" in str(ended[2].error) and not model.stages.decoding
    assert ended[1].stop_reason == "completed" and ended[1].error is None
    torch.testing.assert_close(ended[1].value["video"], reference(folder, reqs[1]), **against("diffusers", "batched"))


def test_a_failed_encode_fails_that_request_alone(model, entry, folder):
    """Encoded together, one prompt fails: the batch is encoded again one by one, the failing request
    leaves with its error before any step, the other steps on and equals WanPipeline's."""
    real = model.family.encode

    def encode(jobs):
        if any(job.request["prompt"] == "refused" for job in jobs):
            if len(jobs) == 1:
                raise RuntimeError("the text encoder refused it")
            raise RuntimeError("one of the batch")
        real(jobs)

    model.family.encode = encode
    reqs = {1: {**BASE, "num_inference_steps": 3, "seed": 5, "output_type": "latent"},
            2: {**BASE, "prompt": "refused", "num_inference_steps": 3, "seed": 6, "output_type": "latent"}}
    ended = run(model, entry, reqs)
    assert ended[2].stop_reason == "error" and "refused it" in str(ended[2].error) and 2 not in model.jobs
    torch.testing.assert_close(ended[1].value["video"], reference(folder, reqs[1]), **against("diffusers", "batched"))


def test_a_late_request_is_encoded_beside_the_running_step(model, entry):
    """B, admitted while A runs, is encoded on the encode stage (not the loop's thread) and steps in the
    iteration that admitted it."""
    threads: list[str] = []
    real = model.family.encode
    model.family.encode = lambda jobs: (threads.append(threading.current_thread().name), real(jobs))
    a = {**BASE, "num_inference_steps": 4, "seed": 7, "output_type": "latent"}
    model.admit(1, entry.sequences(a)[0].payload)
    model.iterate()
    model.admit(2, entry.sequences({**a, "seed": 8, "num_inference_steps": 2})[0].payload)
    out = model.iterate()
    assert out[1].progress == {"step": 2, "of": 4} and out[2].progress == {"step": 1, "of": 2}
    assert len(threads) == 2 and all(name.startswith("phyai-encode") for name in threads)


def test_decoder_views_share_the_weights_and_tile_past_the_threshold(entry, folder):
    """plugin_args vae_tile_pixels: from 64 x 64 pixels per frame up the decode stage's VAE view is the tiled
    one; both views share the VAE's modules; a bad value is refused before any rank, naming the key."""
    ctx = SimpleNamespace(rank=0, device=torch.device("cpu"), parallel=ParallelConfig(), is_output_rank=True,
                          group_rank=lambda name: 0, group_size=lambda name: 1)
    model = entry.create({"model": str(folder), "vae_tile_pixels": 64 * 64}, ctx)
    plain, tiled = model.family.decoder(32, 32), model.family.decoder(64, 64)
    vae = model.components["vae"]
    assert plain is not vae and tiled is not plain and tiled.use_tiling and not plain.use_tiling
    assert not vae.use_tiling and plain.decoder is vae.decoder and tiled.decoder is vae.decoder
    with pytest.raises(ValueError, match=r"vae_tile_pixels'\] = -1"):
        DiffusersPipelineEntry({"model": str(folder), "vae_tile_pixels": -1})


def test_through_the_engine_a_failed_decode_fails_that_request_alone(folder, monkeypatch):
    """An inline engine: B's decode raises; B's future fails with that error, A's video equals
    WanPipeline's, and the engine serves the next request."""
    from phyai_ray import Engine, EngineArgs
    from phyai_ray.models.diffusers_pipeline.wan import WanFamily

    real = WanFamily.decode

    def decode(self, job):
        if job.request["seed"] == 32:
            raise ValueError("the decode of seed 32 failed")
        return real(self, job)

    monkeypatch.setattr(WanFamily, "decode", decode)
    a = {**BASE, "num_inference_steps": 3, "seed": 31, "output_type": "float"}
    b = {**BASE, "prompt": "a cat", "num_inference_steps": 2, "seed": 32, "output_type": "float"}
    plugin = "phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry"
    with Engine(EngineArgs(plugin=plugin, plugin_args={"model": str(folder)})) as engine:
        futures = [engine.submit(r) for r in (a, b)]
        with pytest.raises(ValueError, match="seed 32"):
            futures[1].result(timeout=120)
        torch.testing.assert_close(futures[0].result(timeout=120)["video"], reference(folder, a), **against("diffusers", "batched"))
        assert engine.step({**a, "output_type": "latent"}, timeout=120)["steps"] == 3


def test_iterations_that_only_wait_for_a_decode_are_not_the_loops_pace(folder, monkeypatch):
    """A 2-step request whose decode takes 0.6 s: the iterations after its last step only collect the
    decode (Deltas.stepped False), so the finish-by pace records its 2 steps alone, not those waits."""
    from phyai_ray import Engine, EngineArgs
    from phyai_ray.models.diffusers_pipeline.wan import WanFamily

    real = WanFamily.decode

    def decode(self, job):
        time.sleep(0.6)
        return real(self, job)

    monkeypatch.setattr(WanFamily, "decode", decode)
    plugin = "phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry"
    with Engine(EngineArgs(plugin=plugin, plugin_args={"model": str(folder)})) as engine:
        out = engine.step({**BASE, "num_inference_steps": 2, "seed": 5, "output_type": "float"}, timeout=120)
        assert out["steps"] == 2
        loop = engine._executors[0].queue
        waits = loop.iterations - loop.service._records
        assert loop.service._records == 2 and waits >= 3, (loop.iterations, loop.service._records)


def test_an_encode_that_never_finishes_fails_its_requests_after_the_stage_wait(monkeypatch):
    """The loop waits STAGE_WAIT_S for an encode, no longer: every request of it fails with a TimeoutError."""
    from concurrent.futures import Future

    from phyai_ray.models.diffusers_pipeline import stages

    monkeypatch.setattr(stages, "STAGE_WAIT_S", 0.2)
    work = stages.StageWork(family=None, device="cpu")
    jobs = [SimpleNamespace(cond={}), SimpleNamespace(cond={})]
    began = time.monotonic()
    failed = work.encoded(jobs, Future())  # a future no stage will ever finish
    took = time.monotonic() - began
    assert set(failed) == {id(job) for job in jobs} and 0.2 <= took < 2.0, took
    assert all(isinstance(e, TimeoutError) and "2 request(s) in 0.2 s" in str(e) for e in failed.values())
    work.close()
