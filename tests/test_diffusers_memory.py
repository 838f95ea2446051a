"""`diffusers_pipeline` memory on CPU: sharded loading and sleep, measured as process RSS.

    .venv/bin/python -m pytest tests/test_diffusers_memory.py -q

A Wan folder whose transformer is about 200 MiB (fp32; 12 blocks of dim 512) is written once; one
child process (a clean heap, no other test's garbage) builds rank models from it and reports:
  * the peak RSS of building a tensor-parallel rank (TP=2, rank 1) and a TP=1 rank, each measured
    from a reset peak (/proc/self/clear_refs) after a warm-up load (imports, first allocations): a TP=2 rank
    reads only its slices, so its peak is at most 0.6x the TP=1 rank's (loading.py);
  * sleep(2) of the TP=1 rank: the RSS it gives back against the transformer's bytes (>= 85%),
    and after wake_up + a weight update of every name of weight_specs, the same latents as before;
and through an inline engine (the tiny folder): Engine.sleep(2) reports the freed bytes, and a
WeightSender update after it serves the same latents.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

REQUEST = dict(prompt="a robot arm", negative_prompt="", height=32, width=32, num_frames=9, num_inference_steps=2,
               guidance_scale=4.0, guidance_scale_2=None, seed=1, max_sequence_length=16, output_type="latent",
               image=None, video=None, last_image=None)
PAGE = 4096


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(tiny, big): a tiny Wan folder and a copy of it whose transformer is ~200 MiB."""
    from diffusers import WanTransformer3DModel

    from tests.diffusers_folders import build_wan

    tiny = build_wan(tmp_path_factory.mktemp("memory") / "tiny")
    big = Path(shutil.copytree(tiny, tiny.parent / "big"))
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=2048,
                                        num_layers=12, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        rope_max_seq_len=32)
    for file in (big / "transformer").iterdir():
        file.unlink()
    transformer.save_pretrained(big / "transformer", safe_serialization=True)
    return tiny, big


@pytest.fixture(scope="module")
def report(folder):
    root = Path(__file__).parent.parent
    out = subprocess.run([sys.executable, __file__, *map(str, folder)], capture_output=True, text=True,
                         timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_tp2_rank_peaks_at_most_0_6_of_a_tp1_rank(report):
    tp1, tp2 = report["peak_tp1"], report["peak_tp2"]
    assert tp1 > 180e6, report  # the transformer part is measured
    assert tp2 <= 0.6 * tp1, f"TP=2 rank peak {tp2 / 2**20:.0f} MiB > 0.6 x TP=1 rank {tp1 / 2**20:.0f} MiB"


def test_sleep_2_frees_the_weights_and_wake_plus_update_serves_equal_outputs(report):
    weights = report["weights"]
    assert report["freed_reported"] >= weights
    assert report["rss_freed"] >= 0.85 * weights, (f"sleep(2) gave back {report['rss_freed'] / 2**20:.0f} MiB of "
                                                   f"RSS for {weights / 2**20:.0f} MiB of weights")
    assert report["equal_after_wake"], report


def test_engine_sleep_reports_the_bytes_and_an_update_after_waking_serves_equal_latents(folder):
    from safetensors.torch import load_file

    from phyai_ray import Engine, EngineArgs, WeightSender

    tiny = folder[0]
    saved = {f"transformer.{k}": t for file in sorted((tiny / "transformer").glob("*.safetensors"))
             for k, t in load_file(str(file)).items()}
    with Engine(EngineArgs(plugin="diffusers_pipeline", plugin_args={"model": str(tiny)})) as engine:
        before = engine.step(dict(REQUEST))["video"]
        [report] = engine.sleep(level=2)
        sender = WeightSender("gloo")
        sender.init_transfer(engine)
        sender.update(engine, list(saved.items()), version=1)
        engine.wake_up()
        after = engine.step(dict(REQUEST))["video"]
    [rank] = report.ranks
    assert rank["level"] == 2 and rank["freed_bytes"] >= sum(t.numel() * t.element_size() for t in saved.values())
    assert torch.equal(before, after)


# -- the child process ---------------------------------------------------------------------------------------
class RankContext:
    """The part of a rank's context the model reads: TP over `tp` ranks, this one `rank` (no collectives
    run while loading)."""

    def __init__(self, tp: int, rank: int) -> None:
        from phyai_ray import ParallelConfig
        from phyai_ray.config import AttentionParallelConfig, DenseParallelConfig

        self.tp, self.rank, self.device, self.is_output_rank = tp, rank, torch.device("cpu"), rank == 0
        self.parallel = ParallelConfig(attention=AttentionParallelConfig(tp_size=tp),
                                       dense=DenseParallelConfig(tp_size=tp))

    def group_rank(self, group: str) -> int:
        return self.rank if group.endswith("_tp") else 0

    def group_size(self, group: str) -> int:
        return self.tp if group.endswith("_tp") else 1


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def _peak_of(build):
    """(what build() returns, its peak RSS above the RSS before it)."""
    from phyai_ray.models.diffusers_pipeline.loading import _release

    _release(torch.device("cpu"))
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    base = _rss()
    value = build()
    return value, _status("VmHWM") - base


def _child(tiny: str, big: str) -> dict:
    from phyai_ray.models.diffusers_pipeline.folder import Folder
    from phyai_ray.models.diffusers_pipeline.loading import component_dtypes
    from phyai_ray.models.diffusers_pipeline.model import PipelineModel

    torch.set_num_threads(1)
    dtypes = component_dtypes({}, torch.device("cpu"))

    def model(path: str, tp: int, rank: int) -> PipelineModel:
        return PipelineModel(Folder.open(path), dtypes, RankContext(tp, rank))

    model(tiny, 1, 0)  # imports and first-call allocations, outside the measures
    rank, peak_tp2 = _peak_of(lambda: model(big, 2, 1))
    del rank
    rank, peak_tp1 = _peak_of(lambda: model(big, 1, 0))
    before = rank.step(dict(REQUEST))["video"]
    weights = [(name, t.clone()) for name, t in rank.components["transformer"].state_dict().items()]
    size = sum(t.numel() * t.element_size() for _, t in weights)
    specs = rank.weight_specs()
    from phyai_ray.models.diffusers_pipeline.loading import _release

    _release(torch.device("cpu"))
    rss = _rss()
    freed = rank.sleep(2)
    rss_freed = rss - _rss()
    rank.wake_up(["weights"])
    rank.load_weights([(f"transformer.{name}", t) for name, t in weights if f"transformer.{name}" in specs])
    after = rank.step(dict(REQUEST))["video"]
    return {"peak_tp1": peak_tp1, "peak_tp2": peak_tp2, "weights": size, "freed_reported": freed,
            "rss_freed": rss_freed, "equal_after_wake": bool(torch.equal(before, after))}


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], sys.argv[2])))
