"""A tensor-parallel `torch.nn.Module` whose output reveals its weights, for the weight-update tests.

`reveal_tp` holds `a` [4] and `b` [4] (replicated on every rank) and `ballast.0` ..
`ballast.{chunks-1}`, [n] each, that give the update its size (`plugin_args["ballast"]` = n,
default 1024, and `plugin_args["chunks"]`, default 1). `step({})` all-gathers every rank's
`[a, b]` over dense_tp: a [tp, 8] tensor in which each value is the weight it came from, so a
trainer that fills every tensor with its version number sees at once whether a result came from
one version (every value equal) or from mixed weights. It defines no `load_weights`, so the
engine's default loader (checked names, shapes, dtypes; bucket by bucket) applies.

RPCs for the tests: `stamp()` (wall-clock time this rank ran it), `set_reset_delay(s)` (the
`reset_cache` hook then takes `s` seconds and records when it ran), `control_spans()`,
`reset_peak()` / `peak_bytes()` (the process's peak resident memory, Linux `VmHWM`).
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch

from phyai_ray import Entry, P


class RevealTP(torch.nn.Module):
    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        super().__init__()
        self.ctx = ctx
        self.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        size, chunks = int(plugin_args.get("ballast", 1024)), int(plugin_args.get("chunks", 1))
        self.ballast = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(size), requires_grad=False)
                                               for _ in range(chunks)])
        self.reset_delay_s = 0.0
        self.spans: list[tuple[float, float]] = []

    @torch.no_grad()
    def step(self, request: Any) -> torch.Tensor:
        mine = torch.cat([self.a, self.b])[None]
        return P.all_gather(mine, group="dense_tp")

    def stamp(self) -> float:
        return time.time()

    def set_reset_delay(self, seconds: float) -> float:
        self.reset_delay_s = float(seconds)
        return self.reset_delay_s

    def reset_cache(self) -> None:
        started = time.time()
        time.sleep(self.reset_delay_s)
        self.spans.append((started, time.time()))

    def control_spans(self) -> list[tuple[float, float]]:
        return list(self.spans)

    def reset_peak(self) -> int:
        """Reset this process's peak resident memory to its current size; returns it in bytes."""
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return self.peak_bytes()

    def peak_bytes(self) -> int:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


class RevealTPEntry(Entry):
    name = "reveal_tp"
    parallel_domains = frozenset({"dense"})

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> RevealTP:
        return RevealTP(plugin_args, ctx)


class ShardedReveal:
    """Not a torch module: each rank keeps its half of `a` [4] and all of `b` [4]. It declares the
    full shapes (`weight_specs`), so updates are checked before loading and `load_weights` runs once
    per bucket, slicing its own part; `step` gathers every rank's [a part, b]: [tp, 6]."""

    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        tp, rank = ctx.group_size("dense_tp"), ctx.group_rank("dense_tp")
        self.part = slice(rank * 4 // tp, (rank + 1) * 4 // tp)
        self.a, self.b = torch.zeros(4 // tp), torch.zeros(4)
        self.loads = 0

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"a": ((4,), torch.float32), "b": ((4,), torch.float32)}

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.loads += 1
        for name, tensor in weights:
            if name == "a":
                self.a = tensor[self.part].clone()
            else:
                self.b = tensor.clone()

    def step(self, request: Any) -> torch.Tensor:
        return P.all_gather(torch.cat([self.a, self.b])[None], group="dense_tp")

    def load_calls(self) -> int:
        return self.loads


class ShardedRevealEntry(Entry):
    name = "sharded_reveal"
    parallel_domains = frozenset({"dense"})

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> ShardedReveal:
        return ShardedReveal(plugin_args, ctx)
