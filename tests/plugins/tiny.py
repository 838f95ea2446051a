"""Tiny plugins for tests: a row-parallel TP layer and an inline probe.

`tiny_row_tp` computes y = x @ W.T with W of shape (out_features, in_features). On a dense_tp
group of size n, group rank g holds the input columns [g*in/n, (g+1)*in/n) of W and computes the
partial product of its columns; `P.all_reduce(.., "dense_tp")` sums the partials, so every rank
ends with the full y. W holds small integers, so the sum is exact and the TP=2 result equals the
single-rank one bit for bit:

    W[o, i] = ((o + 1) * (i + 2)) % 7 - 3        e.g. in=4, out=2: [[-1, 0, 1, 2], [1, 3, -2, 0]]

`test_probe` runs inline checks: it records the order in which requests arrive, blocks on a
gate, sleeps, or raises `ProbeError`, depending on the request's "op".
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from phyai_ray import Entry, P, register_plugin


def tiny_weight(out_features: int, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full weight every rank derives its shard from."""
    o = torch.arange(out_features).unsqueeze(1) + 1
    i = torch.arange(in_features).unsqueeze(0) + 2
    return ((o * i) % 7 - 3).to(dtype)


def reference(x: Any, out_features: int = 4) -> torch.Tensor:
    """Single-process result of `tiny_row_tp` for input `x` (batch, in_features)."""
    x = torch.as_tensor(x, dtype=torch.float32)
    return x @ tiny_weight(out_features, x.shape[-1]).T


class TinyRowTP:
    """One rank's column shard of W; `step` returns the all-reduced product."""

    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        in_features = int(plugin_args.get("in_features", 8))
        out_features = int(plugin_args.get("out_features", 4))
        n, g = ctx.group_size("dense_tp"), ctx.group_rank("dense_tp")
        if in_features % n:
            raise ValueError(f"in_features={in_features} does not split over dense_tp={n} ranks")
        width = in_features // n
        self.cols = (g * width, (g + 1) * width)
        self.rank, self.in_features = ctx.rank, in_features
        self.weight = tiny_weight(out_features, in_features, ctx.dtype)[:, self.cols[0]:self.cols[1]].clone()

    def step(self, request: dict[str, Any]) -> torch.Tensor:
        x = torch.as_tensor(request["x"], dtype=self.weight.dtype)
        partial = x[:, self.cols[0]:self.cols[1]] @ self.weight.T
        return P.all_reduce(partial, group="dense_tp")

    def shard(self) -> dict[str, Any]:
        """Which columns this rank holds (for collective_rpc tests)."""
        return {"rank": self.rank, "cols": list(self.cols), "tp_rank": P.rank("dense_tp"), "tp": P.size("dense_tp")}


@register_plugin
class TinyRowTPEntry(Entry):
    name = "tiny_row_tp"
    parallel_domains = frozenset({"dense"})

    def validate_request(self, request: Any) -> None:
        if not isinstance(request, dict) or "x" not in request:
            raise ValueError(f"tiny_row_tp expects {{'x': [[...], ...]}}, got {request!r}")

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> TinyRowTP:
        return TinyRowTP(plugin_args, ctx)


class ProbeError(Exception):
    """Raised by the probe on request; tests check it reaches the caller unchanged."""


class Probe:
    """Records arrival order; "op" selects echo, block (on plugin_args["gate"]), sleep or raise."""

    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        self.gate: threading.Event | None = plugin_args.get("gate")
        self.started: threading.Event | None = plugin_args.get("started")
        self.seen: list[Any] = plugin_args.get("log", [])  # a caller's list lets tests look after failure
        self.ctx = ctx
        self.running = self.most_running = 0  # calls inside step at once: must never pass 1

    def step(self, request: dict[str, Any]) -> Any:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            return self._step(request)
        finally:
            self.running -= 1

    def _step(self, request: dict[str, Any]) -> Any:
        self.seen.append(request.get("tag"))
        if self.started is not None:
            self.started.set()
        op = request["op"]
        if op == "block":
            self.gate.wait(timeout=60)
        elif op == "sleep":
            time.sleep(request["seconds"])
        elif op == "raise":
            raise ProbeError(f"probe asked to fail: {request.get('tag')}")
        elif op == "thread":
            return threading.current_thread().name
        return {"index": len(self.seen) - 1, "tag": request.get("tag")}

    def concurrency(self) -> int:
        return self.most_running

    def history(self) -> list[Any]:
        return list(self.seen)

    def add(self, a: int, b: int = 0) -> int:
        return a + b


@register_plugin
class ProbeEntry(Entry):
    name = "test_probe"
    ops = ("echo", "block", "sleep", "raise", "thread")

    def validate_request(self, request: Any) -> None:
        if not isinstance(request, dict) or request.get("op") not in self.ops:
            raise ValueError(f"test_probe requests need op in {self.ops}, got {request!r}")

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> Probe:
        return Probe(plugin_args, ctx)
