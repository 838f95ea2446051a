"""`diffusers_pipeline` encodes on ONE rank of a replica: the text / image encoders live only there.

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_diffusers_encode_rank.py -q

On real Ray groups of 2 rank actors (gloo), the per-rank `component_bytes` (through collective_rpc)
shows that only the encoding rank (the output rank, rank 0) holds text-encoder weights: as many bytes
as UMT5 loaded by transformers, against 0 on rank 1; and on a Wan image-to-video CFG=2 group, the
CLIP image encoder and the VAE (which encodes the conditioning frame) on rank 0 only too. The outputs
still equal diffusers: Wan under TP=2 (1e-5: the row-parallel sums round, as in
tests/test_diffusers_layouts.py), one request alone and three of different prompts, steps and
guidance batched per step; Wan I2V under CFG=2, where rank 1 computes the uncond
rows from embeddings it received (1e-5). Ranks as threads over real gloo groups (the harness of
tests/test_diffusers_layouts.py): under TP=2 an encode that fails on the encoding rank ends that
request on both ranks (rank 0 with its own error, rank 1 naming rank 0), rank 1 never encodes, the
other request equals WanPipeline and is the same on both ranks bit for bit; and `step` (one request
alone, on the caller's thread) equals it too.
"""

from __future__ import annotations

import pytest
import torch

from phyai_ray import AttentionParallelConfig, DenseParallelConfig, OuterParallelConfig, ParallelConfig
from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry
from tests.conftest import closed_together, submitted_together
from tests.test_diffusers_layouts import on_ranks
from tests.test_diffusers_pipeline import BASE, reference, wan_folders  # noqa: F401
from tests.test_diffusers_pipeline_ray import diffusers_group
from tests.test_diffusers_wan_i2v import BASE as I2V_BASE, folder as i2v_folder, picture  # noqa: F401
from tests.test_diffusers_wan_i2v import reference as i2v_reference
from tests.tolerances import against

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)

TP2 = ParallelConfig(attention=AttentionParallelConfig(tp_size=2), dense=DenseParallelConfig(tp_size=2))
CFG2 = ParallelConfig(outer=OuterParallelConfig(cfg_size=2))


def _bytes(folder, name: str) -> int:
    """The parameter bytes of component `name` as its library loads it from the folder (float32 on CPU)."""
    import importlib
    import json

    library, cls = json.loads((folder / "model_index.json").read_text())[name]
    model = getattr(importlib.import_module(library), cls).from_pretrained(folder / name)
    return sum(p.numel() * p.element_size() for p in model.float().parameters())


@pytest.fixture(scope="module")
def groups(wan_folders, i2v_folder):  # noqa: F811
    yield from closed_together({"tp2": lambda: diffusers_group(wan_folders["wan21"], TP2),
                                "i2v_cfg2": lambda: diffusers_group(i2v_folder, CFG2)})


@pytest.fixture
def tp2(groups):
    return groups["tp2"]


@pytest.fixture
def i2v_cfg2(groups):
    return groups["i2v_cfg2"]


def test_tp2_only_the_encoding_rank_holds_the_text_encoder(tp2, wan_folders):  # noqa: F811
    rank0, rank1 = tp2.collective_rpc("component_bytes", replica=0, all_ranks=True)
    assert rank0["text_encoder"] == _bytes(wan_folders["wan21"], "text_encoder") > 0
    assert rank1["text_encoder"] == 0 and rank1["vae"] == 0
    assert rank0["transformer"] == rank1["transformer"] > 0  # each its half


def test_tp2_outputs_equal_wan_pipeline_alone_and_batched(tp2, wan_folders):  # noqa: F811
    folder = wan_folders["wan21"]
    alone = {**BASE, "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 5}
    torch.testing.assert_close(tp2.step({**alone, "output_type": "latent"})["video"], reference(folder, alone),
                               **against("diffusers", "batched"))
    requests = [{**BASE, "num_inference_steps": 4, "guidance_scale": 5.0, "seed": 1},
                {**BASE, "prompt": "a cat", "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 2},
                {**BASE, "prompt": "a dog runs left", "num_inference_steps": 3, "guidance_scale": 2.5, "seed": 3}]
    futures = submitted_together(tp2, [{**r, "output_type": "latent"} for r in requests])
    for future, request in zip(futures, requests):
        torch.testing.assert_close(future.result()["video"], reference(folder, request), **against("diffusers", "batched"))


def test_i2v_cfg2_encoders_and_vae_on_rank_0_only_and_outputs_equal_the_pipeline(i2v_cfg2, i2v_folder):  # noqa: F811
    rank0, rank1 = i2v_cfg2.collective_rpc("component_bytes", replica=0, all_ranks=True)
    for name in ("text_encoder", "image_encoder", "vae"):
        assert rank0[name] == _bytes(i2v_folder, name) > 0 and rank1[name] == 0, name
    requests = [{**I2V_BASE, "image": picture(31), "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 31},
                {**I2V_BASE, "prompt": "a cat", "image": picture(32, 32, 32), "num_inference_steps": 2,
                 "guidance_scale": 1.0, "seed": 32}]
    futures = submitted_together(i2v_cfg2, [{**r, "output_type": "latent"} for r in requests])
    for future, request in zip(futures, requests):
        torch.testing.assert_close(future.result()["video"], i2v_reference(i2v_folder, request), **against("diffusers", "batched"))


def test_a_failed_encode_on_the_encoding_rank_ends_the_request_on_every_rank(wan_folders):  # noqa: F811
    folder = wan_folders["wan21"]
    args = {"model": str(folder)}
    entry = DiffusersPipelineEntry(args)
    entry.check_parallel(TP2)
    good = {**BASE, "num_inference_steps": 3, "guidance_scale": 4.0, "seed": 7}
    bad = {**BASE, "prompt": "refused", "num_inference_steps": 2, "guidance_scale": 4.0, "seed": 8}
    payloads = [entry.sequences({**r, "output_type": "latent"})[0].payload for r in (good, bad)]

    def build(ctx):
        model = entry.create(args, ctx)
        real, calls = model.family.encode, []

        def encode(jobs):
            calls.append(len(jobs))
            if any(job.request["prompt"] == "refused" for job in jobs):
                raise ValueError("the text encoder refused the prompt")
            real(jobs)

        model.family.encode = encode
        return model, calls

    def run(built):
        model, calls = built
        alone = model.step(payloads[0])  # one request on the caller's thread, encoded on rank 0 only
        for ident, payload in enumerate(payloads):
            model.admit(ident, payload)
        ended = {}
        while len(ended) < len(payloads):
            ended.update({k: d for k, d in model.iterate().items() if d.stop_reason is not None})
        return alone, ended, calls, model.component_bytes()["text_encoder"]

    (alone, ended0, calls0, text0), (none, ended1, calls1, text1) = on_ranks(TP2, build, run)
    torch.testing.assert_close(alone["video"], reference(folder, good), **against("diffusers", "batched"))
    assert none is None and text1 == 0 < text0
    assert calls1 == [] and calls0 == [1, 2, 1, 1]  # step's; the plan's pair, then one by one to find whose
    assert ended0[1].stop_reason == "error" and "refused the prompt" in str(ended0[1].error)
    assert ended1[1].stop_reason == "error" and "failed on rank 0" in str(ended1[1].error)
    assert ended0[0].stop_reason == ended1[0].stop_reason == "completed"
    torch.testing.assert_close(ended0[0].value["video"], reference(folder, good), **against("diffusers", "batched"))
    assert torch.equal(ended0[0].value["video"], ended1[0].value["video"])  # the same embeddings, bit for bit
