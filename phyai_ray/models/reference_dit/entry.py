"""`ReferenceDiTEntry`: the built-in reference parallel plugin, `plugin="reference_dit"`.

    from phyai_ray import Engine, EngineArgs
    args = EngineArgs(plugin="reference_dit", plugin_args={"seed": 0, "layers": 4})
    with Engine(args) as engine:
        logits = engine.step({"tokens": [[1, 2, 3, 4]], "labels": [3], "guidance_scale": 4.0})

It implements all five domains (dense TP/DP, attention TP/CP/DP, MoE TP/EP/DP, pipeline, CFG),
so it serves as the ground truth of the framework's topologies: every layout must give the
single-rank result (float32, relative error <= 1e-5).

The model's shape lives in plugin_args, and the checks that combine shape and topology need them:
`configure(plugin_args)` (or `ReferenceDiTEntry(plugin_args)`) tells the entry. Until then
`validate_parallel` cannot check the shape and `validate_request` checks only what holds for
every shape; `create` always re-checks with the real plugin_args on every rank.
"""

from __future__ import annotations

from typing import Any

from phyai_ray.models.reference_dit.config import ReferenceDiTConfig, check_topology
from phyai_ray.models.reference_dit.model import ReferenceDiT
from phyai_ray.models.reference_dit.request import (ReferenceDiTRequest, batch_key, check_layout, check_request,
                                                    request_size)
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.registry import register_plugin
from phyai_ray.plugins.signature import TensorSpec


_ANY_SHAPE = ReferenceDiTConfig(vocab=1 << 20, classes=1 << 16, max_seq=1 << 16)  # bounds of every model


class _Shape:
    """What `check_layout` reads of a request: its batch and sequence length."""

    def __init__(self, batch: int, seq: int) -> None:
        self.batch, self.seq = batch, seq


@register_plugin
class ReferenceDiTEntry(Entry):
    """Small DiT-style transformer with MoE blocks and classifier-free guidance, seeded weights."""

    name = "reference_dit"
    parallel_domains = frozenset({"dense", "attention", "moe", "pipeline", "cfg"})
    default_max_batch_size = 64  # step_batch: requests of one batch key as one forward
    request_model = ReferenceDiTRequest
    inputs = (TensorSpec("tokens", "INT64", (-1, -1)), TensorSpec("labels", "INT64", (-1,), optional=True))
    outputs = (TensorSpec("logits", "FP32", (-1, -1, -1)),)

    def __init__(self, plugin_args: dict[str, Any] | None = None) -> None:
        self.config: ReferenceDiTConfig | None = None
        self.parallel: Any = None
        if plugin_args is not None:
            self.configure(plugin_args)

    def configure(self, plugin_args: dict[str, Any] | None) -> None:
        """Tell the entry the model's plugin_args so its checks use the real shape."""
        self.config = ReferenceDiTConfig.from_args(plugin_args)

    def validate_parallel(self, parallel: Any) -> None:
        if self.config is not None:
            check_topology(self.config, parallel)
        self.parallel = parallel  # remembered for the request-time layout check

    def validate_request(self, request: Any) -> None:
        cfg = self.config or _ANY_SHAPE
        batch, seq = check_request(request, cfg)
        if self.parallel is not None:
            check_layout(_Shape(batch, seq), self.parallel)

    def batch_key(self, request: Any) -> tuple:
        """(sequence length, guidance scale): requests that differ in either never share a forward."""
        return batch_key(request)

    def request_size(self, request: Any) -> int:
        return request_size(request)

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> ReferenceDiT:
        return ReferenceDiT(ReferenceDiTConfig.from_args(plugin_args), ctx)
