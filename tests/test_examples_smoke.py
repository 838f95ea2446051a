"""Smoke runs of the main demo and the benchmark script (their `main()`), against the session's Ray."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.ray


def _load(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_serves_two_tp2_replicas_matching_the_single_rank_model(ray_session, capsys):
    assert _load("examples/demo.py").main(n=4) == 0
    out = capsys.readouterr().out
    assert "demo: OK" in out and "replica 1: healthy=True ranks=2" in out


def test_benchmark_prints_ratios_and_names_the_machine(ray_session, capsys, monkeypatch):
    bench = _load("benchmarks/bench_engine.py")
    monkeypatch.setattr(bench.ray, "init", lambda **kwargs: None)      # reuse the session's Ray
    monkeypatch.setattr(bench.ray, "shutdown", lambda: None)
    bench.main(["--requests", "20", "--max-replicas", "1", "--large", "1"])
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "Ray request path (2 ranks)" in out
    for ratio in ("default step / floor (p50)", "1 replica(s) x 10 ms", "64 MB result speed / bare ray.get",
                  "64 MB request speed / bare broadcast"):
        assert ratio in out and "target" in out.split(ratio, 1)[1].splitlines()[0], ratio


def test_rl_loop_learns_and_every_rollout_carries_the_pushed_version(ray_session, capsys):
    # main() raises if any rollout's weight version differs from the one just pushed. Chance level
    # of the reward is 1/32 (vocab 32); with the fixed seeds the policy gradient moves most of the
    # mass to the target token within three updates, so the last of four iterations is far above
    # the first (0.05 -> ~0.97 in a 12-iteration run; a margin of 0.3 leaves room for float noise).
    curve = _load("examples/rl_loop.py").main(iterations=4)
    assert curve[0] < 0.2 and curve[-1] > curve[0] + 0.3, curve
    assert "pushed version 4" in capsys.readouterr().out


def test_hf_rl_loop_learns_with_a_transformers_policy_synced_by_name(ray_session, capsys):
    # main() raises if a rollout's version differs from the one just pushed, or if the trainer's
    # transformers forward gives log-probs more than 1e-4 away from the rollout's.
    pytest.importorskip("transformers")
    curve = _load("examples/hf_rl_loop.py").main(iterations=5)
    assert curve[-1] > curve[0] + 0.2, curve
    out = capsys.readouterr().out
    assert "pushed version 5" in out and "|trainer - rollout log-prob| <=" in out
