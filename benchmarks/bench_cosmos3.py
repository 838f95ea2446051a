"""Cosmos3: `diffusers_pipeline` packing every request into one forward per step vs diffusers' own pipeline.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_cosmos3.py [--repeats 3] [--json out.json]`

A Cosmos3OmniPipeline folder written by tests/cosmos3_folders.py with a larger transformer (hidden
128, 4 layers, 16 query heads on 8 key/value heads of 16; the Wan 2.2-layout VAE of the tests).
Every request: 4 steps with CFG (guidance 6), seeds 0..n-1.

1. Throughput: 8 concurrent requests, mixed: 4 text-to-video (9 frames 64x64, prompts of different
   lengths) and 4 policy requests (a DROID chunk of 8 from a 64x64 frame, tier 256) through the
   Engine (inline, one rank) vs Cosmos3OmniPipeline called once per request in sequence (diffusers
   runs one sample per call). Target: engine >= 1.2x.
2. Robots: the policy chunk's latency when 8 robots ask at once (one packed forward per step) vs
   one robot alone. Target: <= 4x alone (8 chunks for at most 4x the time of one).
Prints the machine first; medians and p99 over `--repeats`; each ratio with its target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_world import engine_run, machine, p99  # noqa: E402
from results import add_flag, record, write  # noqa: E402

from phyai_ray import Engine, EngineArgs  # noqa: E402

FRAME = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
PROMPTS = ("a robot arm picks up the red cube", "a dog runs", "camera moves left slowly on the table",
           "a cat runs fast")
STEPS = {"num_inference_steps": 4, "guidance_scale": 6.0, "output_type": "float"}


def video(i: int) -> dict[str, Any]:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "num_frames": 9, "height": 64, "width": 64, "seed": i, **STEPS}


def policy(i: int) -> dict[str, Any]:
    return {"prompt": "pick up the red cube", "image": FRAME, "seed": i, **STEPS,
            "action": {"mode": "policy", "chunk_size": 8, "domain_name": "droid_lerobot", "resolution_tier": 256}}


def diffusers_call(pipe: Any, r: dict[str, Any]) -> Any:
    """Cosmos3OmniPipeline for one request, as the engine's request means it."""
    from diffusers import CosmosActionCondition

    kwargs: dict[str, Any] = {}
    if r.get("action") is not None:
        a = r["action"]
        kwargs["action"] = CosmosActionCondition(mode=a["mode"], chunk_size=a["chunk_size"],
                                                 domain_name=a["domain_name"], resolution_tier=a["resolution_tier"],
                                                 image=r["image"])
    else:
        kwargs.update(num_frames=r["num_frames"], height=r["height"], width=r["width"])
    with torch.no_grad():
        return pipe(r["prompt"], num_inference_steps=r["num_inference_steps"], guidance_scale=r["guidance_scale"],
                    generator=torch.Generator("cpu").manual_seed(r["seed"]), output_type="np", **kwargs)


def runs(fn: Any, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def throughput(pipe: Any, engine: Engine, repeats: int) -> float:
    batch = [video(i) if i % 2 else policy(i) for i in range(8)]
    packed = runs(lambda: engine_run(engine, batch), repeats)
    alone = runs(lambda: [diffusers_call(pipe, r) for r in batch], repeats)
    ratio = statistics.median(alone) / statistics.median(packed)
    print(f"8 mixed requests (4 text-to-video, 4 policy), 4 steps, CFG: engine {statistics.median(packed):.2f}s "
          f"(p99 {p99(packed):.2f}), diffusers once per request {statistics.median(alone):.2f}s (p99 "
          f"{p99(alone):.2f}); throughput {ratio:.2f}x (target >= 1.2x)", flush=True)
    record("throughput", engine_s=statistics.median(packed), diffusers_s=statistics.median(alone), ratio=ratio)
    return ratio


def robots(engine: Engine, repeats: int) -> float:
    many: list[float] = []
    one: list[float] = []
    engine_run(engine, [policy(0)])  # warm-up
    for _ in range(repeats):
        many += engine_run(engine, [policy(i) for i in range(8)])
        one += engine_run(engine, [policy(0)])
    ratio = statistics.median(many) / statistics.median(one)
    print(f"policy chunk latency: 8 robots at once {statistics.median(many):.2f}s (p99 {p99(many):.2f}), one robot "
          f"alone {statistics.median(one):.2f}s (p99 {p99(one):.2f}); {ratio:.2f}x alone for 8x the chunks "
          "(target <= 4x)", flush=True)
    record("robots", eight_s=statistics.median(many), alone_s=statistics.median(one), ratio=ratio)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    add_flag(parser)
    args = parser.parse_args()
    from tests.cosmos3_folders import build_cosmos3, load_cosmos3_pipeline

    print(machine(), flush=True)
    with tempfile.TemporaryDirectory() as root:
        folder = build_cosmos3(Path(root) / "cosmos3", hidden=128, layers=4)
        pipe = load_cosmos3_pipeline(folder)
        with Engine(EngineArgs(plugin="diffusers_pipeline", plugin_args={"model": str(folder)})) as engine:
            throughput(pipe, engine, args.repeats)
            robots(engine, args.repeats)
    write(args.json, "cosmos3", machine())


if __name__ == "__main__":
    main()
