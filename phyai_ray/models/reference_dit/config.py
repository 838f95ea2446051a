"""Plugin arguments of the reference transformer, and which topologies it can run.

Every rank rebuilds the same full weights from `seed` and keeps its shard, so the arguments
below are the whole model description. The topology checks are pure index math:

    heads % attention.tp == 0      each attention-TP rank owns heads/tp whole heads
    hidden % dense.tp == 0         dense up/down projections split by rows/columns
    expert_hidden % moe.tp == 0    each expert's projections split the same way
    experts % moe.ep == 0          each EP rank owns a contiguous block of experts/ep
    layers % pp == 0               each stage owns layers/pp contiguous blocks

Batch and sequence divisibility depend on the request and are checked in `request.py`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from phyai_ray.errors import ParallelConfigError
from phyai_ray.nn.shape import TransformerShape


class ReferenceDiTConfig(TransformerShape):
    """Shape and seed of the reference transformer (the `plugin_args` of `reference_dit`)."""

    @classmethod
    def from_args(cls, plugin_args: dict[str, Any] | None) -> "ReferenceDiTConfig":
        """Validate plugin_args; a bad value is a `ValueError` naming the field."""
        try:
            return cls(**(plugin_args or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid plugin_args for reference_dit: {exc}") from None


def check_topology(cfg: ReferenceDiTConfig, parallel: Any) -> None:
    """Raise `ParallelConfigError` when `parallel` cannot split a model of shape `cfg`."""
    rules = [
        ("heads", cfg.heads, "attention.tp_size", parallel.attention.tp_size),
        ("hidden (mlp_ratio * dim)", cfg.hidden, "dense.tp_size", parallel.dense.tp_size),
        ("expert_hidden", cfg.expert_width, "moe.tp_size", parallel.moe.tp_size),
        ("experts", cfg.experts, "moe.ep_size", parallel.moe.ep_size),
        ("layers", cfg.layers, "outer.pp_size", parallel.outer.pp_size),
    ]
    bad = [f"{what}={n} is not divisible by {axis}={size}" for what, n, axis, size in rules if n % size]
    if bad:
        raise ParallelConfigError(
            f"reference_dit cannot run {parallel.describe()}: {'; '.join(bad)}. Pick degrees that divide "
            "the model shape, or change plugin_args (e.g. heads, experts, layers).")
