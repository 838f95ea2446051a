"""Turns at a per-step budget of one request: a 4-step preview beside a 40-step job, `diffusers_pipeline`.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_turns.py [--repeats 5]`

The tiny random Wan 2.1 folder of tests/diffusers_folders.py (a 9-frame 32x32 request with CFG; its
transformer steps in milliseconds), one inline rank, `max_latent_tokens_per_step=1`: every request is
larger than the budget, so one request steps per iteration. A 40-step job is submitted; once it has
taken 4 steps, a 4-step preview. Reported, with `over_budget="turns"` (the default) and `"wait"`
(admission only when a request fits) side by side, alternating, median and p99 over `--repeats`:

    preview / job   the preview's latency (submit to decoded video) over the job's (the issue's goal:
                    <= 0.5; before turns, the preview waited out the job: 0.94 in the issue's run)
    iterations      how many iterations the preview's latency spanned, of the job's
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_world import machine  # noqa: E402
from phyai_ray import BatchingConfig, DeploymentConfig, Engine, EngineArgs  # noqa: E402
from tests.diffusers_folders import build_wan  # noqa: E402

PLUGIN = "phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry"
BASE = {"prompt": "a robot arm picks up the red cube", "negative_prompt": "blue box", "height": 32, "width": 32,
        "num_frames": 9, "guidance_scale": 4.0}


def one_run(folder: Path, over_budget: str) -> tuple[float, float]:
    """(preview latency / job latency, preview iterations / job iterations) of one run."""
    deployment = DeploymentConfig(batching=BatchingConfig(over_budget=over_budget))
    args = EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder), "max_latent_tokens_per_step": 1})
    with Engine(args, deployment) as engine:
        engine.step({**BASE, "num_inference_steps": 2, "seed": 0})  # warm
        loop = engine._executors[0].queue
        start_it, started = loop.iterations, time.monotonic()
        job = engine.submit({**BASE, "num_inference_steps": 40, "seed": 1})
        while loop.iterations < start_it + 4:
            time.sleep(0.001)
        sent, sent_it = time.monotonic(), loop.iterations
        preview = engine.submit({**BASE, "num_inference_steps": 4, "seed": 2})
        preview.result(timeout=600)
        done, done_it = time.monotonic(), loop.iterations
        job.result(timeout=600)
        ended, ended_it = time.monotonic(), loop.iterations
    return (done - sent) / (ended - started), (done_it - sent_it) / (ended_it - start_it)


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(int(0.99 * len(ordered)), len(ordered) - 1)]
    return f"median {statistics.median(values):.3f}, p99 {p99:.3f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args(argv)
    print(machine())
    runs: dict[str, list[tuple[float, float]]] = {"turns": [], "wait": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_wan(Path(tmp) / "wan21")
        for _ in range(opts.repeats):
            for mode in runs:  # alternating: both modes see the same machine
                runs[mode].append(one_run(folder, mode))
    for mode, values in runs.items():
        print(f"over_budget={mode!r:8} preview / job time: {summary([v[0] for v in values])}; "
              f"iterations: {summary([v[1] for v in values])}")
    return runs


if __name__ == "__main__":
    main()
