"""The main demo: serve the reference transformer on a local Ray instance and send it requests.

Run: `make demo` (or `.venv/bin/python examples/demo.py`)

Starts 2 replicas x tensor-parallel 2 of the built-in `reference_dit` plugin (4 rank actors in
2 placement groups, gloo on CPU), sends concurrent requests through the dispatcher, checks every
result against the single-rank model run inline, and prints where each replica ran and what it served.
"""

from __future__ import annotations

import logging
import time

import torch

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                       EngineArgs, EngineConfig, ParallelConfig)

PLUGIN_ARGS = {"seed": 0}


def requests(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"tokens": torch.randint(0, 64, (2, 8), generator=g).tolist(), "labels": [i % 4, (i + 1) % 4],
             "guidance_scale": 3.0} for i in range(n)]


def engine_args(tp: int) -> EngineArgs:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
    return EngineArgs(plugin="reference_dit", plugin_args=PLUGIN_ARGS,
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))


def main(n: int = 16) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    batch = requests(n)
    with Engine(engine_args(1)) as single:
        expected = [single.step(r) for r in batch]
    print(f"single-rank reference computed inline for {n} requests")
    start = time.perf_counter()
    with Engine(engine_args(2), DeploymentConfig.local(replica_count=2)) as engine:
        print(f"engine mode={engine.mode}: 2 replicas x TP=2 ready in {time.perf_counter() - start:.1f}s")
        start = time.perf_counter()
        results = [f.result(timeout=120) for f in [engine.submit(r) for r in batch]]
        elapsed = time.perf_counter() - start
        worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(results, expected))
        print(f"{n} requests in {elapsed:.2f}s; logits {tuple(results[0].shape)}; "
              f"max relative difference to single rank {worst:.2e}")
        for s in engine.replica_status():
            print(f"replica {s.index}: healthy={s.healthy} ranks={s.world_size} served={s.served} "
                  f"node={s.nodes[0][:12] if s.nodes else '-'}")
    ok = worst <= 1e-5
    print("demo:", "OK, TP=2 replicas match the single-rank model" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
