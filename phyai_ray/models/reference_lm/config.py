"""Plugin arguments and requests of `reference_lm`.

    plugin_args  {"seed": 0, "dim": 64, "heads": 4, "layers": 2, "vocab": 128, "max_seq": 256,
                  "kv_cache_blocks": 1024}
    request      {"prompts": [[1, 2, 3], [4, 5]], "max_tokens": 16, "temperature": 0.0, "top_k": 0,
                  "top_p": 1.0, "seed": 0, "stop_token_ids": [0]}

    sequence     {"prompt": [1, 2, 3], "max_tokens": 16, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                  "seed": sequence_seed(0, 0), "stop_token_ids": [0]}      one per prompt (`payloads`)

Topology: dense TP and attention TP (heads % tp == 0, hidden % tp == 0); dp is replication.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from phyai_ray.llm.blocks import blocks_for
from phyai_ray.llm.sampling import Sampling, sequence_seed
from phyai_ray.llm.topology import decoder_rules, refuse
from phyai_ray.nn.shape import TransformerShape

KV_BLOCK_SIZE = 16  # tokens per KV block
KV_SEQUENCES = 64  # the default KV cache holds this many sequences of max_seq


class ReferenceLMConfig(BaseModel):
    """Shape and seed of the reference LM (the `plugin_args` of `reference_lm`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(0, ge=0, description="Seed of the deterministic weights.")
    dim: int = Field(64, ge=1, le=8192, description="Model width.")
    heads: int = Field(4, ge=1, le=512, description="Attention heads; dim must divide into them.")
    layers: int = Field(2, ge=1, le=512, description="Transformer blocks.")
    mlp_ratio: int = Field(4, ge=1, le=64, description="MLP hidden size = mlp_ratio * dim.")
    vocab: int = Field(128, ge=2, le=1 << 20, description="Token vocabulary.")
    max_seq: int = Field(256, ge=2, le=1 << 16, description="Longest prompt + completion.")
    kv_cache_blocks: int | None = Field(None, ge=1, le=1 << 24, description="Blocks of the KV cache (16 tokens "
                                        "each, never fewer than one max_seq sequence needs); default: room for 64 "
                                        "sequences of max_seq. Sequences beyond it wait for blocks.")

    @model_validator(mode="after")
    def _check(self) -> "ReferenceLMConfig":
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} does not split into heads={self.heads}; pick a multiple of heads")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < blocks_for(self.max_seq, KV_BLOCK_SIZE):
            raise ValueError(f"kv_cache_blocks={self.kv_cache_blocks} holds fewer than one sequence of max_seq="
                             f"{self.max_seq} needs ({blocks_for(self.max_seq, KV_BLOCK_SIZE)} blocks of "
                             f"{KV_BLOCK_SIZE} tokens); raise it or lower max_seq")
        return self

    def cache_blocks(self) -> int:
        """Blocks of the KV cache: `kv_cache_blocks`, or room for KV_SEQUENCES sequences of max_seq."""
        return self.kv_cache_blocks or KV_SEQUENCES * blocks_for(self.max_seq, KV_BLOCK_SIZE)

    @classmethod
    def from_args(cls, plugin_args: dict[str, Any] | None) -> "ReferenceLMConfig":
        try:
            return cls(**(plugin_args or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid plugin_args for reference_lm: {exc}") from None

    def blocks_config(self) -> TransformerShape:
        """The reference transformer's shape whose dense blocks this LM reuses (same seeded draws)."""
        return TransformerShape(seed=self.seed, dim=self.dim, heads=self.heads, layers=self.layers,
                                  mlp_ratio=self.mlp_ratio, moe_every=0, vocab=self.vocab, max_seq=self.max_seq,
                                  classes=1)


def check_topology(cfg: ReferenceLMConfig, parallel: Any) -> None:
    ta, td, hidden = parallel.attention.tp_size, parallel.dense.tp_size, cfg.mlp_ratio * cfg.dim
    refuse("reference_lm", parallel, [(cfg.heads % ta == 0, f"heads={cfg.heads} % attention.tp={ta}"),
                                      (hidden % td == 0, f"hidden={hidden} % dense.tp={td}"),
                                      *decoder_rules(parallel)])


class GenerateRequest(Sampling):
    """A batch of prompts (token ids, any lengths) and how to continue them."""

    prompts: list[list[int]] = Field(min_length=1, max_length=1024, description="Prompt token ids, one list each.")

    @classmethod
    def parse(cls, request: Any, cfg: ReferenceLMConfig) -> "GenerateRequest":
        try:
            req = cls.model_validate(request)
        except ValidationError as exc:
            raise ValueError(f"reference_lm request: {exc}") from None
        bad = [t for p in req.prompts for t in p if not 0 <= t < cfg.vocab] + \
              [t for t in req.stop_token_ids if not 0 <= t < cfg.vocab] + \
              [t for t in req.logit_bias if not 0 <= t < cfg.vocab]
        if bad or any(not p for p in req.prompts):
            raise ValueError(f"reference_lm request: prompts must be non-empty and every id in [0, {cfg.vocab}); "
                             f"got out-of-range ids {bad[:5]}")
        longest = max(len(p) for p in req.prompts) + req.max_tokens
        if longest > cfg.max_seq:
            raise ValueError(f"reference_lm request: longest prompt + max_tokens = {longest} exceeds max_seq="
                             f"{cfg.max_seq}; shorten it or lower max_tokens")
        return req

    def payloads(self) -> list[dict[str, Any]]:
        """One sequence payload per prompt (what `ReferenceLM.admit` takes), seeded by `sequence_seed`.

            GenerateRequest(prompts=[[1, 2], [1, 2]], seed=3).payloads()[1]["seed"] == sequence_seed(3, 1)
        """
        shared = self.shared_payload(list(self.stop_token_ids))
        return [{"prompt": list(p), **shared, "seed": sequence_seed(self.seed, i)} for i, p in enumerate(self.prompts)]
