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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from phyai_ray.errors import ParallelConfigError


class ReferenceDiTConfig(BaseModel):
    """Shape and seed of the reference transformer (the `plugin_args` of `reference_dit`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(0, ge=0, description="Seed of the deterministic weights; equal seeds give equal models.")
    dim: int = Field(64, ge=1, le=8192, description="Model width (token embedding size).")
    heads: int = Field(4, ge=1, le=512, description="Attention heads; dim must divide into them.")
    layers: int = Field(4, ge=1, le=512, description="Transformer blocks.")
    mlp_ratio: int = Field(4, ge=1, le=64, description="Dense MLP hidden size = mlp_ratio * dim.")
    experts: int = Field(4, ge=1, le=1024, description="Experts of every MoE block.")
    top_k: int = Field(2, ge=1, le=1024, description="Experts each token is routed to.")
    expert_hidden: int | None = Field(None, ge=1, description="Hidden size of one expert (default 2 * dim).")
    moe_every: int = Field(2, ge=0, le=512, description="Every n-th block has a MoE MLP (0: no MoE block).")
    vocab: int = Field(128, ge=2, le=1 << 20, description="Token vocabulary; the output has vocab logits.")
    max_seq: int = Field(64, ge=1, le=1 << 16, description="Longest sequence (size of the position table).")
    classes: int = Field(10, ge=1, le=1 << 16, description="Condition labels; label `classes` is the null one.")

    @model_validator(mode="after")
    def _check_shape(self) -> "ReferenceDiTConfig":
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} does not split into heads={self.heads} equal heads; "
                             "pick dim a multiple of heads")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} is larger than experts={self.experts}")
        return self

    @classmethod
    def from_args(cls, plugin_args: dict[str, Any] | None) -> "ReferenceDiTConfig":
        """Validate plugin_args; a bad value is a `ValueError` naming the field."""
        try:
            return cls(**(plugin_args or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid plugin_args for reference_dit: {exc}") from None

    @property
    def hidden(self) -> int:
        return self.mlp_ratio * self.dim

    @property
    def expert_width(self) -> int:
        return self.expert_hidden or 2 * self.dim

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def is_moe_block(self, index: int) -> bool:
        """Block `index` (0-based) has a MoE MLP: with moe_every=2, blocks 1, 3, 5, ..."""
        return self.moe_every > 0 and index % self.moe_every == self.moe_every - 1


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
