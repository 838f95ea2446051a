"""benchmarks/gpu_smoke.py's robot-policy part, dry run: pi0.5's path at a tiny size on CPU.

Run: `.venv/bin/python -m pytest tests/test_lerobot_policy_gpu_smoke.py -q` (no Ray, no GPU).

On a GPU the same function builds pi0.5 at its real size with random bf16 weights and times a lone
frame and 16 robots per expert step; here it checks the path in float32 (a lone frame, a 4-robot batch
through the iteration protocol, the timings printed).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_the_gpu_smoke_policy_part_dry_runs_on_cpu(capsys):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("gpu_smoke", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.check_policy(dry_run=True)
    out = capsys.readouterr().out
    assert "policy pi0.5, dry run" in out and "4 robots per expert step" in out
