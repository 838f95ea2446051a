"""GPU smoke check: one replica with NCCL groups over every visible GPU, CUDA tensors back to the caller.

Run on a machine with CUDA GPUs: `.venv/bin/python benchmarks/gpu_smoke.py`
Exits 0 when the TP result equals a single-GPU reference and a CUDA tensor reached the caller;
exits 2 (and says so) when no GPU is visible.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       Entry, P, ParallelConfig)


class RowParallelMatmul:
    """y = x @ W.T with W's input columns split over dense_tp; partial products all-reduced over NCCL."""

    def __init__(self, plugin_args: dict, ctx: Any) -> None:
        full = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))
        n, g = ctx.group_size("dense_tp"), ctx.group_rank("dense_tp")
        self.cols = slice(g * 4096 // n, (g + 1) * 4096 // n)
        self.weight = full[:, self.cols].to(ctx.device)
        self.device = ctx.device

    def step(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.device)[:, self.cols] @ self.weight.T
        return P.all_reduce(y, group="dense_tp")

    def device_name(self) -> str:
        return f"{self.device} {torch.cuda.get_device_name(self.device)} backend={torch.distributed.get_backend()}"


class SmokeEntry(Entry):
    name = "gpu_smoke"
    parallel_domains = frozenset({"dense"})

    def create(self, plugin_args: dict, ctx: Any) -> RowParallelMatmul:
        return RowParallelMatmul(plugin_args, ctx)


def main() -> int:
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("gpu_smoke: no CUDA GPU visible; nothing to check")
        return 2
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=gpus)) if gpus > 1 else ParallelConfig()
    args = EngineArgs(plugin=SmokeEntry, config=EngineConfig(device=DeviceConfig(target="cuda"), parallel=parallel))
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(1))
    expected = x @ torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0)).T
    start = time.perf_counter()
    with Engine(args, DeploymentConfig.local(devices=tuple(range(gpus)))) as engine:
        print(f"startup {time.perf_counter() - start:.1f}s, mode={engine.mode}, tp={gpus}")
        print("ranks:", engine.collective_rpc("device_name", replica=0, all_ranks=True))
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            y = engine.step(x)
            times.append(time.perf_counter() - t0)
        print(f"result on {y.device}, dtype {y.dtype}, shape {tuple(y.shape)}")
        error = (y.cpu() - expected).abs().max().item() / expected.abs().max().item()
        times.sort()
        print(f"step latency median {times[len(times) // 2] * 1e3:.2f} ms, max {times[-1] * 1e3:.2f} ms; "
              f"relative error vs CPU reference {error:.2e}")
    ok = y.is_cuda and error < 1e-3
    print("gpu_smoke:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
