"""`diffusers_pipeline` limits from the model, checked once before any rank, and the real-size plans.

    .venv/bin/python -m pytest tests/test_diffusers_limits.py -q

The limits come from the folder's configs (request.py `Limits`, entry.py `limits_of`): the real
configs of tests/data/real_configs/ give Wan 2.1's and Cosmos-Predict2.5's numbers without weights;
a tiny folder shows the oversized request refused by an inline engine in well under a second,
naming the limit and the plugin_args key, the engine serving on. The real-size plan table
(scripts/real_size_plans.py) runs on three of the real configs.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

from phyai_ray.models.diffusers_pipeline.entry import limits_of  # noqa: E402
from phyai_ray.models.diffusers_pipeline.folder import Folder, PipelineFolderError  # noqa: E402
from phyai_ray.models.diffusers_pipeline.request import VideoRequest, VideoRequestError  # noqa: E402

REAL = Path(__file__).parent / "data" / "real_configs"
HUGE = {"prompt": "a robot arm", "height": 4096, "width": 4096, "num_frames": 401}


def real(name: str) -> Folder:
    return Folder.open(REAL / name, weights=False)


def test_wan_limits_come_from_its_config_and_refuse_the_oversized_request():
    folder = real("Wan2.1-T2V-1.3B")
    limits = limits_of(folder, {})
    assert limits.max_frames == 161 and limits.max_pixels == 4 * 480 * 832  # the default shape x the margins
    assert limits.max_side == (1024 * 2 * 8, 1024 * 2 * 8) and limits.max_sequence_length == 512
    with pytest.raises(VideoRequestError, match=r"max_pixels=1597440 \(plugin_args\['max_pixels'\]"):
        VideoRequest.parse(HUGE, limits)
    with pytest.raises(VideoRequestError, match=r"num_frames=401 is over the limit max_frames=161 .*'max_frames'"):
        VideoRequest.parse({**HUGE, "height": 480, "width": 832}, limits)
    with pytest.raises(VideoRequestError, match=r"max_sequence_length=513 .* limit max_sequence_length=512"):
        VideoRequest.parse({"prompt": "a", "max_sequence_length": 513}, limits)
    VideoRequest.parse({"prompt": "a", "height": 720, "width": 1280, "num_frames": 161}, limits)  # 720p passes
    wide = limits_of(folder, {"max_frames": 401, "max_pixels": 4096 * 4096})
    VideoRequest.parse(HUGE, wide)  # plugin_args lift them, up to the positional range
    with pytest.raises(PipelineFolderError, match=r"max_frames.* must be an int in \[1, 4093\]"):
        limits_of(folder, {"max_frames": 5000})


def test_denoising_steps_are_bounded_by_the_schedulers_timesteps_and_plugin_args():
    """A request for 10**9 steps was accepted and ran; now the scheduler's num_train_timesteps bound it (a
    plugin_args value may set fewer, never more), for Wan, Cosmos-Predict2.5 and Cosmos3 requests alike."""
    from phyai_ray.models.diffusers_pipeline.cosmos3_request import parse
    from tests.cosmos3_folders import build_cosmos3

    for name in ("Wan2.1-T2V-1.3B", "Cosmos-Predict2.5-2B"):
        folder = real(name)
        limits = limits_of(folder, {})
        assert limits.max_steps == folder.step_range() == folder.configs["scheduler"]["num_train_timesteps"]
        with pytest.raises(VideoRequestError, match=rf"num_inference_steps=1000000000 .* max_inference_steps="
                                                    rf"{limits.max_steps}"):
            VideoRequest.parse({"prompt": "a", "num_inference_steps": 10 ** 9}, limits)
        VideoRequest.parse({"prompt": "a", "num_inference_steps": limits.max_steps}, limits)
        with pytest.raises(VideoRequestError, match="max_inference_steps=50 "):
            VideoRequest.parse({"prompt": "a", "num_inference_steps": 51}, limits_of(folder, {"max_inference_steps": 50}))
        with pytest.raises(PipelineFolderError, match="max_inference_steps.* must be an int in"):
            limits_of(folder, {"max_inference_steps": limits.max_steps + 1})
    import tempfile

    cosmos3 = Folder.open(build_cosmos3(Path(tempfile.mkdtemp(prefix="cosmos3-")) / "f"))
    with pytest.raises(VideoRequestError, match="num_inference_steps=1000000000 is over the limit"):
        parse({"prompt": "a", "num_frames": 9, "height": 32, "width": 32, "num_inference_steps": 10 ** 9}, cosmos3,
              limits_of(cosmos3, {}))


def test_cosmos_limits_reach_its_max_size_and_its_text_encoder():
    limits = limits_of(real("Cosmos-Predict2.5-2B"), {})
    assert limits.max_side == (1920, 1920) and limits.max_sequence_length == 128000
    assert limits.max_frames == 185 and limits.max_pixels == 4 * 704 * 1280
    with pytest.raises(VideoRequestError, match="positional range"):
        VideoRequest.parse({"prompt": "a", "height": 1920 + 64, "width": 1280}, limits)


def test_an_oversized_request_is_refused_before_any_rank_in_under_a_second(tmp_path):
    """(And a safety_checker for a Wan folder is refused, not ignored: its decode checks no video.)"""
    from phyai_ray import Engine, EngineArgs
    from phyai_ray.errors import RequestRejectedError
    from tests.diffusers_folders import build_wan

    from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry

    folder = build_wan(tmp_path / "wan")  # rope_max_seq_len 32: 512 pixels a side
    with pytest.raises(PipelineFolderError, match="safety_checker'] is for folders whose decode checks"):
        DiffusersPipelineEntry({"model": str(folder), "safety_checker": "tests.diffusers_cosmos:StandInSafetyChecker"})
    plugin_args = {"model": str(folder), "max_pixels": 256 * 256, "max_frames": 17}
    with Engine(EngineArgs(plugin="diffusers_pipeline", plugin_args=plugin_args)) as engine:
        steps = {"prompt": "a", "height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 10 ** 9}
        for request, named in ((HUGE, "positional range"), ({**HUGE, "height": 512, "width": 256}, "max_pixels"),
                               ({**HUGE, "height": 32, "width": 32}, "max_frames"),
                               (steps, r"num_inference_steps=1000000000 is over the limit max_inference_steps")):
            start = time.monotonic()
            with pytest.raises(RequestRejectedError, match=named):
                engine.step(request)
            assert time.monotonic() - start < 1.0
        small = {"prompt": "a robot arm", "height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 1,
                 "max_sequence_length": 16, "output_type": "latent"}
        assert tuple(engine.step(small)["video"].shape) == (16, 3, 4, 4)  # it serves on


def test_real_size_plans_print_per_rank_bytes_dtypes_and_budget():
    from scripts.real_size_plans import REAL as SCRIPT_REAL
    from scripts.real_size_plans import main

    assert SCRIPT_REAL == REAL.resolve()
    out = main([str(REAL / name) for name in ("Wan2.1-T2V-1.3B", "Wan2.2-TI2V-5B", "Cosmos-Predict2.5-2B")])
    rows = [line.split(" | ") for line in out.splitlines()[2:]]
    assert len(rows) == 9 and all("transformer bfloat16" in r[1] and "vae float32" in r[1] for r in rows)
    by = {(r[0].strip("| "), r[2]): r for r in rows}
    tp, ulysses = by["Wan2.1-T2V-1.3B", "TP 2"], by["Wan2.1-T2V-1.3B", "Ulysses 2"]
    transformer = [float(cell.split("(")[1].split(" + ")[0]) for cell in (tp[3], ulysses[3])]
    assert transformer[0] <= 0.55 * transformer[1]  # tensor parallel halves the split weights
    assert tp[4].endswith("+ 0.00)") and not tp[3].endswith("+ 0.00)")  # the VAE on the output rank only
    for model in ("Wan2.1-T2V-1.3B", "Cosmos-Predict2.5-2B"):  # the output rank alone encodes (encode_rank.py)
        rank0, rank1 = by[model, "CFG 2"][3:5]
        assert " + 0.0 + 0.00)" in rank1 and float(rank0.split(" + ")[1]) > 10  # UMT5-XXL / Qwen2.5-VL on rank 0
    assert "131,040 (2.0 requests)" in tp[7] and "704 x 1280 x 93" in by["Cosmos-Predict2.5-2B", "TP 2"][5]
