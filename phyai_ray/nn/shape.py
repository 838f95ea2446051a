"""The shape of the reference transformer, read by its seeded weights (`weights.py`) and layers.

    shape = TransformerShape(dim=64, heads=4, layers=4, moe_every=2)
    shape.head_dim == 16; shape.is_moe_block(1) is True; shape.hidden == 256

`reference_dit` serves it as its plugin_args (`ReferenceDiTConfig` adds the parsing); `reference_lm`
builds one from its own arguments to reuse the same blocks and the same seeded draws.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TransformerShape(BaseModel):
    """Shape and seed of the reference transformer: what its seeded weights and sharded layers read."""

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
    def _check_shape(self) -> "TransformerShape":
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} does not split into heads={self.heads} equal heads; "
                             "pick dim a multiple of heads")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} is larger than experts={self.experts}")
        return self

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
