"""GPU smoke check: NCCL groups over every visible GPU, CUDA tensors back to the caller, GPU weight sync.

Run on a machine with CUDA GPUs: `.venv/bin/python benchmarks/gpu_smoke.py`
1. one replica with NCCL groups over every visible GPU: the TP result equals a CPU reference and
   arrives as a CUDA tensor on the output rank's device (CUDA IPC over the same-node request lane);
   every rank sees every GPU and binds its own (`cuda:k` is the same GPU in every process); a CUDA
   request tensor reaches every rank as the caller's `cuda:0` tensor;
2. RL weight sync on GPU: `cuda_ipc` (trainer and rank on GPU 0) and, with 2+ GPUs, `nccl` (rank on
   GPU 1); the rank's output equals the trainer's module; `sleep(level=2)` frees the rank's weight
   memory and a weight update refills it.
Exits 0 when every check passes; exits 2 (and says so) when no GPU is visible.
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

    def visibility(self) -> tuple[str | None, int, int]:
        """(CUDA_VISIBLE_DEVICES, current device, device count) as this rank sees them."""
        import os

        return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.current_device(), torch.cuda.device_count()

    def echo(self, x: torch.Tensor) -> tuple[str, float]:
        """Where a CUDA request tensor arrived, and its sum."""
        return str(x.device), float(x.sum())

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
        transport = engine._executors[0].transport
        seen = engine.collective_rpc("visibility", replica=0, all_ranks=True)
        x_gpu = x.cuda(0)
        echoed = engine.collective_rpc("echo", x_gpu, replica=0, all_ranks=True)
        visible_ok = [(current, count) for _, current, count in seen] == [(r, gpus) for r in range(gpus)]
        echo_ok = all(d == "cuda:0" and abs(total - float(x_gpu.sum())) < 1e-2 for d, total in echoed)
        print(f"transport {transport}; ranks see {seen}: {'OK' if visible_ok else 'FAILED'} (each rank sees every GPU "
              f"and binds its own); a cuda:0 request arrives as {echoed}: {'OK' if echo_ok else 'FAILED'}")
        times.sort()
        print(f"step latency median {times[len(times) // 2] * 1e3:.2f} ms, max {times[-1] * 1e3:.2f} ms; "
              f"relative error vs CPU reference {error:.2e}")
    ok = y.is_cuda and y.device == torch.device("cuda", 0) and error < 1e-3 and visible_ok and echo_ok
    ok = ok and transport == "ipc"
    ok = check_weight_sync("cuda_ipc", device=0) and ok
    if gpus > 1:
        ok = check_weight_sync("nccl", device=1) and ok
    print("gpu_smoke:", "OK" if ok else "FAILED")
    return 0 if ok else 1


class CudaPolicy(torch.nn.Module):
    """A plain nn.Module on the rank's GPU: the default sleep / wake / load_weights hooks apply."""

    def __init__(self, plugin_args: dict, ctx: Any) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1024, 1024).to(ctx.device)

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.to(self.linear.weight.device))

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()


class PolicyEntry(Entry):
    name = "gpu_smoke_policy"

    def create(self, plugin_args: dict, ctx: Any) -> CudaPolicy:
        return CudaPolicy(plugin_args, ctx)


def check_weight_sync(backend: str, device: int) -> bool:
    """Sleep level 2, sync new weights with `backend` from this process (on GPU 0), wake, compare."""
    from phyai_ray import WeightSender

    trainer = torch.nn.Linear(1024, 1024).cuda(0)
    x = torch.randn(8, 1024, device="cuda:0")
    args = EngineArgs(plugin=PolicyEntry, config=EngineConfig(device=DeviceConfig(target="cuda")))
    with Engine(args, DeploymentConfig.local(devices=(device,))) as engine:
        before = engine.collective_rpc("allocated", replica=0)
        engine.sleep(level=2)
        asleep = engine.collective_rpc("allocated", replica=0)
        sender = WeightSender(backend)
        sender.init_transfer(engine)
        params = [(f"linear.{k}", v) for k, v in trainer.state_dict().items()]
        reports = sender.update(engine, params, version=1)
        engine.wake_up()
        y = engine.step(x)
        with torch.no_grad():
            error = (y.to("cuda:0") - trainer(x)).abs().max().item()
    ok = asleep < before and all(r.error is None for r in reports) and error < 1e-5
    print(f"weight sync {backend} (rank on GPU {device}): allocated {before} -> asleep {asleep} bytes, "
          f"max error {error:.2e}, reports {[r.state for r in reports]}: {'OK' if ok else 'FAILED'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
