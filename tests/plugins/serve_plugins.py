"""A plugin for the HTTP tests: `tiny_row_tp` with a typed request model and a sleep knob.

    POST /v1/step {"x": {"__tensor__": {"dtype": "float32", "shape": [2, 8], "data": "..."}}, "sleep_s": 0}
    -> {"result": {"y": {"__tensor__": {... [2, 4] ...}}, "tp": 2, "pid": 4242}}

`y` equals `tests.plugins.tiny.reference(x)` bit for bit on any dense_tp size (integer weights).
`sleep_s` makes every rank sleep first, so a request can outlive `execution_timeout_s`.
`pid` is the output rank's process (inline: the Serve replica's): it names the group that served.
`step_batch` runs several requests as one product (`batch`: how many shared the step).
The validator rejects an `x` that is not [batch, 8] before any rank sees it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from phyai_ray import Entry, P, register_plugin
from phyai_ray.serve.protocols.schema import EncodedTensor
from tests.plugins.tiny import TinyRowTP

IN_FEATURES = 8


class RowRequest(BaseModel):
    """One request: an input [batch, 8] (encoded tensor or nested list) and an optional sleep."""

    model_config = ConfigDict(extra="forbid")

    x: EncodedTensor | list[list[float]] = Field(description=f"Input [batch, {IN_FEATURES}].")
    sleep_s: float = Field(0.0, ge=0, le=120, description="Every rank sleeps this long before computing.")


class ServedRowTP(TinyRowTP):
    def step(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.step_batch([request])[0]

    def step_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows of every request as one product; `batch` is how many requests shared the step."""
        pause = max(float(r.get("sleep_s") or 0.0) for r in requests)
        if pause:
            time.sleep(pause)
        xs = [torch.as_tensor(r["x"], dtype=self.weight.dtype) for r in requests]
        y = super().step({"x": torch.cat(xs)})
        return [{"y": part, "tp": P.size("dense_tp"), "pid": os.getpid(), "batch": len(requests)}
                for part in y.split([x.shape[0] for x in xs])]


@register_plugin
class ServeRowTPEntry(Entry):
    name = "serve_row_tp"
    parallel_domains = frozenset({"dense"})
    request_model = RowRequest

    def validate_request(self, request: Any) -> None:
        x = request.get("x") if isinstance(request, dict) else None
        shape = list(x.shape) if isinstance(x, torch.Tensor) else [len(x), len(x[0]) if x else 0] if x else None
        if shape is None or len(shape) != 2 or shape[1] != IN_FEATURES:
            raise ValueError(f"serve_row_tp expects x of shape [batch, {IN_FEATURES}], got {shape}")

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> ServedRowTP:
        return ServedRowTP({"in_features": IN_FEATURES, **plugin_args}, ctx)
