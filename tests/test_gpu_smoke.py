"""benchmarks/gpu_smoke.py's parts, dry run: each model family's GPU path at a tiny size on CPU (no Ray, no GPU).

Run: `.venv/bin/python -m pytest tests/test_gpu_smoke.py -q`

On a GPU each part builds the real config with random bf16 weights (Wan2.1-T2V-1.3B, pi0.5,
Qwen3-1.7B) and times it against the reference library; here the same functions check the path in
float32: the world model's latents equal WanPipeline's, the policy runs a lone frame and a 4-robot
batch through the iteration protocol, and hf_causal_lm's 8 one-prompt requests agree with
transformers' batched generate. Each printed line is what the docs quote from a GPU run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)
PARTS = {  # part -> (what its dry run prints, a package the part needs beyond torch)
    "check_world_model": (["world model, dry run (CPU, tiny), 9x32x32: step"], "diffusers"),
    "check_policy": (["policy pi0.5, dry run", "4 robots per expert step"], None),
    "check_llm": (["llm hf_causal_lm, dry run", "first tokens equal 8/8"], "transformers"),
}


def _smoke():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("gpu_smoke", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("part", sorted(PARTS))
def test_the_gpu_smoke_part_dry_runs_on_cpu(part, capsys):
    printed, needs = PARTS[part]
    if needs is not None:
        pytest.importorskip(needs)
    assert getattr(_smoke(), part)(dry_run=True)
    out = capsys.readouterr().out
    assert all(line in out for line in printed), out
