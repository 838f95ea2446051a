"""A Ray job: run the reference plugin as replica groups on a running cluster and check the results.

    ray start --head --num-cpus 4
    ray job submit --working-dir . -- python examples/job_step.py --tp 2 --replicas 2

Inside a job `RAY_ADDRESS` names the cluster, so `DeploymentConfig.cluster(address="auto")`
joins it (run directly, the script joins the cluster `ray start` left on this machine). Each
replica is one placement group of `tp` rank actors (gloo on CPU); the logits of every request
must match the single-rank (inline, no Ray) logits of the same request.
"""

from __future__ import annotations

import argparse
from typing import Sequence

import torch

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                       EngineArgs, EngineConfig, ParallelConfig)

REQUESTS = [{"tokens": [[3, 1, 4, 1], [5, 9, 2, 6]], "labels": [7, 2], "guidance_scale": 4.0},
            {"tokens": [[2, 7, 1, 8, 2, 8]]},
            {"tokens": [[1, 4, 1, 4], [2, 1, 3, 5]], "labels": [0, 9]},
            {"tokens": [[6, 6, 6, 6, 6, 6, 6, 6]], "guidance_scale": 1.5}]


def engine_args(tp: int) -> EngineArgs:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
    return EngineArgs(plugin="reference_dit", plugin_args={"seed": 1},
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))


def run(args: EngineArgs, deployment: DeploymentConfig | None = None) -> tuple[list[torch.Tensor], list]:
    """Logits of every request (submitted at once, so the replicas share them) and replica status."""
    with Engine(args, deployment) as engine:
        futures = [engine.submit(request) for request in REQUESTS]
        logits = [f.result(timeout=300).clone() for f in futures]
        return logits, engine.replica_status()


def main(argv: Sequence[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree per replica (default 2)")
    parser.add_argument("--replicas", type=int, default=2, help="replica groups (default 2)")
    parser.add_argument("--address", default="auto", help="Ray address (default: auto = RAY_ADDRESS or ray start)")
    opts = parser.parse_args(argv)
    expected, _ = run(engine_args(1))
    got, status = run(engine_args(opts.tp), DeploymentConfig.cluster(address=opts.address, replica_count=opts.replicas))
    error = max(((g - e).norm() / e.norm()).item() for g, e in zip(got, expected))
    for s in status:
        print(f"replica {s.index}: {s.world_size} ranks on node(s) {sorted({n[:8] for n in s.nodes})}, "
              f"served {s.served}, healthy {s.healthy}")
    print(f"job_step: {len(got)} requests on {opts.replicas} replica(s) x tp={opts.tp}; "
          f"max relative error vs one rank {error:.2e} ({'OK' if error < 1e-5 else 'MISMATCH'})")
    return error


if __name__ == "__main__":
    main()
