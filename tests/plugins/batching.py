"""`batch_probe`: a batchable plugin that records every batch on every rank, for the batching tests.

    {"tag": 7, "x": 2.0, "key": "a", "n": 1, "op": "echo" | "fail_item" | "raise_batch", "sleep": 0.0}
    -> {"tag": 7, "y": x * scale, "agree": True, "batch": [tags of its batch]}

`key` is the batch key and `n` the request's samples. Each step all-reduces a checksum of the
batch's tags over `dense_tp`, so `agree` says every rank ran the same batch; `batches()` gives a
rank's history (collective_rpc with all_ranks=True gives every rank's). `scale` is a parameter of
an `nn.Module`, so the default weight-update hooks replace it and `y` reveals which weights ran.
"op": "fail_item" returns an exception for that request only; "raise_batch" raises from step_batch.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch

from phyai_ray import Entry, P, register_plugin


class ItemError(ValueError):
    """Returned (not raised) for a request with op "fail_item"."""


class BatchRaised(RuntimeError):
    """Raised from step_batch when a request of the batch has op "raise_batch"."""


class BatchProbe(torch.nn.Module):
    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)
        self.history: list[list[Any]] = []
        self.steps = 0

    def step(self, request: dict[str, Any]) -> Any:
        self.steps += 1
        return self.step_batch([request])[0]

    @torch.no_grad()
    def step_batch(self, requests: list[dict[str, Any]]) -> list[Any]:
        tags = [r.get("tag") for r in requests]
        self.history.append(tags)
        pause = max(float(r.get("sleep", 0.0)) for r in requests)
        if pause:
            time.sleep(pause)
        if any(r.get("op") == "raise_batch" for r in requests):
            raise BatchRaised(f"step_batch asked to raise: batch {tags}")
        mine = torch.tensor([float(len(tags)), float(sum(zlib.crc32(str(t).encode()) % 9973 for t in tags))], dtype=torch.float64)
        agree = bool(torch.equal(P.all_reduce(mine.clone(), group="dense_tp"), mine * P.size("dense_tp")))
        scale = float(self.scale.item())
        return [ItemError(f"item {r.get('tag')} asked to fail") if r.get("op") == "fail_item" else
                {"tag": r.get("tag"), "y": float(r.get("x", 1.0)) * scale, "agree": agree, "batch": tags}
                for r in requests]

    def batches(self) -> list[list[Any]]:
        return [list(b) for b in self.history]

    def single_steps(self) -> int:
        return self.steps


@register_plugin
class BatchProbeEntry(Entry):
    name = "batch_probe"
    parallel_domains = frozenset({"dense"})

    def validate_request(self, request: Any) -> None:
        if not isinstance(request, dict) or request.get("op", "echo") not in ("echo", "fail_item", "raise_batch"):
            raise ValueError(f"batch_probe requests need op in echo, fail_item, raise_batch; got {request!r}")

    def batch_key(self, request: Any) -> Any:
        return request.get("key")

    def request_size(self, request: Any) -> int:
        return int(request.get("n", 1))

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> BatchProbe:
        return BatchProbe(plugin_args, ctx)
