"""Cosmos3: `diffusers_pipeline` packing every request into one forward per step vs diffusers' own pipeline.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_cosmos3.py [--repeats 3] [--json out.json]`, or as
the last part of `benchmarks/bench_world.py` (`--only-cosmos3` for this part alone), which calls `cosmos3_runs`.

A Cosmos3OmniPipeline folder written by tests/cosmos3_folders.py with a larger transformer (hidden
128, 4 layers, 16 query heads on 8 key/value heads of 16; the Wan 2.2-layout VAE of the tests).
Every request: 4 steps with CFG (guidance 6), seeds 0..n-1.

1. Throughput: 8 concurrent requests, mixed: 4 text-to-video (9 frames 64x64, prompts of different
   lengths) and 4 policy requests (a DROID chunk of 8 from a 64x64 frame, tier 256) through the
   Engine (inline, one rank) vs Cosmos3OmniPipeline called once per request in sequence (diffusers
   runs one sample per call). Target: engine >= 1.2x.
2. Robots: the policy chunk's latency when 8 robots ask at once (one packed forward per step) vs
   one robot alone, as action requests (the chunk and its decoded video) and as the openpi frames a
   robot sends (plugin_args["policy"]: the chunk alone, no VAE decode). Target: <= 4x alone (8 chunks
   for at most 4x the time of one).
Prints the machine first; medians and p99 over `--repeats`; each ratio with its target. Tables
"cosmos3_throughput" and "cosmos3_robots" in the `--json` file (benchmarks/results.py).
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


POLICY = {"chunk_size": 8, "domain_name": "droid_lerobot", "resolution_tier": 256,
          "num_inference_steps": STEPS["num_inference_steps"], "guidance_scale": STEPS["guidance_scale"]}


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


def throughput(pipe: Any, engine: Engine, repeats: int) -> dict[str, float]:
    batch = [video(i) if i % 2 else policy(i) for i in range(8)]
    packed = runs(lambda: engine_run(engine, batch), repeats)
    alone = runs(lambda: [diffusers_call(pipe, r) for r in batch], repeats)
    ratio = statistics.median(alone) / statistics.median(packed)
    print(f"8 mixed requests (4 text-to-video, 4 policy), 4 steps, CFG: engine {statistics.median(packed):.2f}s "
          f"(p99 {p99(packed):.2f}), diffusers once per request {statistics.median(alone):.2f}s (p99 "
          f"{p99(alone):.2f}); throughput {ratio:.2f}x (target >= 1.2x)", flush=True)
    row = {"engine_s": statistics.median(packed), "engine_p99_s": p99(packed), "diffusers_s": statistics.median(alone),
           "diffusers_p99_s": p99(alone), "ratio": ratio}
    record("cosmos3_throughput", **row)
    return row


def frame(i: int) -> dict[str, Any]:
    """The same policy chunk as an openpi frame (plugin_args["policy"] = POLICY): no video decoded."""
    return {"observation/image": FRAME, "prompt": "pick up the red cube", "seed": i}


def robots(engine: Engine, repeats: int, make: Any = policy, what: str = "action requests") -> dict[str, float]:
    many: list[float] = []
    one: list[float] = []
    engine_run(engine, [make(0)])  # warm-up
    for _ in range(repeats):
        many += engine_run(engine, [make(i) for i in range(8)])
        one += engine_run(engine, [make(0)])
    ratio = statistics.median(many) / statistics.median(one)
    print(f"policy chunk latency ({what}): 8 robots at once {statistics.median(many):.2f}s (p99 {p99(many):.2f}), "
          f"one robot alone {statistics.median(one):.2f}s (p99 {p99(one):.2f}); {ratio:.2f}x alone for 8x the "
          "chunks (target <= 4x)", flush=True)
    row = {"eight_s": statistics.median(many), "eight_p99_s": p99(many), "alone_s": statistics.median(one),
           "alone_p99_s": p99(one), "ratio": ratio}
    record("cosmos3_robots", request=what, **row)
    return row


def cosmos3_runs(repeats: int) -> dict[str, dict[str, float]]:
    """Parts 1 and 2 on a folder built for the run (printed and recorded): {"throughput", "robots",
    "robot_frames"}; the robots as action requests (chunk and decoded video) and as openpi frames (the chunk)."""
    from tests.cosmos3_folders import build_cosmos3, load_cosmos3_pipeline

    with tempfile.TemporaryDirectory() as root:
        folder = build_cosmos3(Path(root) / "cosmos3", hidden=128, layers=4)
        pipe = load_cosmos3_pipeline(folder)
        args = {"model": str(folder), "policy": POLICY}
        with Engine(EngineArgs(plugin="diffusers_pipeline", plugin_args=args)) as engine:
            return {"throughput": throughput(pipe, engine, repeats),
                    "robots": robots(engine, repeats, policy, "action requests: chunk and decoded video"),
                    "robot_frames": robots(engine, repeats, frame, "openpi frames: the chunk alone")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    add_flag(parser)
    args = parser.parse_args()
    print(machine(), flush=True)
    cosmos3_runs(args.repeats)
    write(args.json, "cosmos3", machine())


if __name__ == "__main__":
    main()
