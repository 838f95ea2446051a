"""Plugins that misbehave on purpose, for the Ray fail-fast tests.

`slow_tp`   sleeps `request["sleep"]` seconds, then all-reduces over dense_tp (a stuck peer blocks it).
`fail_create` raises `CreateFailed` in `create` on the rank given by plugin_args["fail_rank"].
"""

from __future__ import annotations

import time
from typing import Any

import torch

from phyai_ray import Entry, P


class CreateFailed(RuntimeError):
    """Raised on purpose while building a rank."""


class RequestRejected(ValueError):
    """Raised by the slow plugin's validator."""


class SlowTP:
    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        self.ctx = ctx
        self.executed_tags: list[Any] = []

    def step(self, request: dict[str, Any]) -> torch.Tensor:
        self.executed_tags.append(request.get("tag"))
        time.sleep(float(request.get("sleep", 0.0)))
        return P.all_reduce(torch.ones(2) * (self.ctx.rank + 1), group="dense_tp")

    def executed(self) -> list[Any]:
        """Tags of every request this rank ran, in order."""
        return list(self.executed_tags)

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail_on(self, rank: int) -> int:
        """Raise on `rank` only (the others return): a rank's own exception must fail its replica."""
        if self.ctx.rank == rank:
            raise RequestRejected(f"rank {rank} fails on purpose (test)")
        return self.ctx.rank

    def scribble(self, tensor: torch.Tensor) -> float:
        """Add rank + 1 to `tensor` in place, wait for every rank to have done so, read it back."""
        tensor.add_(self.ctx.rank + 1)
        P.barrier("world")
        return float(tensor[0]) + float(tensor[-1])

    def arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32) * (self.ctx.rank + 1)

    def whoami(self) -> dict[str, Any]:
        import os
        return {"rank": self.ctx.rank, "pid": os.getpid(), "replica": self.ctx.replica_index}


class SlowTPEntry(Entry):
    name = "slow_tp"
    parallel_domains = frozenset({"dense"})

    def validate_request(self, request: Any) -> None:
        if not isinstance(request, dict) or float(request.get("sleep", 0.0)) < 0:
            raise RequestRejected(f"slow_tp wants {{'sleep': seconds >= 0}}, got {request!r}")

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> SlowTP:
        return SlowTP(plugin_args, ctx)


class FailCreateEntry(Entry):
    name = "fail_create"
    parallel_domains = frozenset({"dense"})

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> SlowTP:
        if ctx.rank == plugin_args.get("fail_rank", 1):
            raise CreateFailed(f"rank {ctx.rank} refuses to build (test)")
        P.barrier("world")  # the healthy rank waits in a collective for the failed one
        return SlowTP(plugin_args, ctx)
