"""benchmarks/gpu_smoke.py's LLM part, dry run: Qwen3's path at a tiny size on CPU (no Ray, no GPU).

The GPU run takes Qwen3-1.7B's real config with random bf16 weights; here a tiny float32 Qwen3
generates 8 one-prompt requests through hf_causal_lm and transformers' batched generate agrees.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_the_gpu_smoke_llm_part_dry_runs_on_cpu(capsys):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("gpu_smoke", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.check_llm(dry_run=True)
    out = capsys.readouterr().out
    assert "llm hf_causal_lm, dry run" in out and "first tokens equal 8/8" in out
