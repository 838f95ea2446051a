"""Under torchrun: open, use and close four external engines one after another in each process.

Each rank appends `engine <i> <rank> <ok>` lines to DIR/rank<RANK>.txt (ok: the output rank's
result equals the single-rank answer; the other rank got None).
"""

from __future__ import annotations

import os
import sys

import torch

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       ParallelConfig, WorkerSupervisorConfig)
from tests.plugins.tiny import TinyRowTPEntry, reference
from tests.scripts.launch import finish_rank


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    args = EngineArgs(plugin=TinyRowTPEntry, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    deployment = DeploymentConfig.external(process_config=WorkerSupervisorConfig(startup_timeout_s=20))
    lines = []
    for i in range(4):
        with Engine(args, deployment) as engine:
            x = torch.full((2, 8), float(i))
            out = engine.step({"x": x}, timeout=20)
            ok = torch.equal(out, reference(x)) if rank == 0 else out is None
            lines.append(f"engine {i} {rank} {ok}\n")
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.writelines(lines)


if __name__ == "__main__":
    main(sys.argv[1])
    finish_rank()
