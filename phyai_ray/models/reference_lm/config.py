"""Plugin arguments and requests of `reference_lm`.

    plugin_args  {"seed": 0, "dim": 64, "heads": 4, "layers": 2, "vocab": 128, "max_seq": 256}
    request      {"prompts": [[1, 2, 3], [4, 5]], "max_tokens": 16, "temperature": 0.0, "top_k": 0,
                  "top_p": 1.0, "seed": 0, "stop_token_ids": [0]}

    sequence     {"prompt": [1, 2, 3], "max_tokens": 16, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                  "seed": sequence_seed(0, 0), "stop_token_ids": [0]}      one per prompt (`payloads`)

Topology: dense TP and attention TP (heads % tp == 0, hidden % tp == 0); dp is replication.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from phyai_ray.errors import ParallelConfigError
from phyai_ray.models.reference_dit.config import ReferenceDiTConfig


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

    @model_validator(mode="after")
    def _check(self) -> "ReferenceLMConfig":
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} does not split into heads={self.heads}; pick a multiple of heads")
        return self

    @classmethod
    def from_args(cls, plugin_args: dict[str, Any] | None) -> "ReferenceLMConfig":
        try:
            return cls(**(plugin_args or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid plugin_args for reference_lm: {exc}") from None

    def blocks_config(self) -> ReferenceDiTConfig:
        """The reference model's config whose dense blocks this LM reuses (same seeded draws)."""
        return ReferenceDiTConfig(seed=self.seed, dim=self.dim, heads=self.heads, layers=self.layers,
                                  mlp_ratio=self.mlp_ratio, moe_every=0, vocab=self.vocab, max_seq=self.max_seq,
                                  classes=1)


def decoder_rules(parallel: Any) -> list[tuple[bool, str]]:
    """What every slot decoder (reference_lm, hf_causal_lm) needs of a topology besides its own divisibility."""
    return [(parallel.outer.pp_size == 1 and parallel.outer.cfg_size == 1, "pp and cfg must be 1"),
            (getattr(parallel.attention, "cp_size", 1) == 1, "attention.cp must be 1 (decode is one token)"),
            (all(getattr(parallel, d).dp_size == 1 for d in ("dense", "attention") if d in parallel.explicit_domains),
             "an explicit dp must be 1 (the batch is not split)")]


def refuse(plugin: str, parallel: Any, rules: list[tuple[bool, str]], where: str = "") -> None:
    bad = [why for ok, why in rules if not ok]
    if bad:
        raise ParallelConfigError(f"{plugin} cannot run {parallel.describe()}{where}: {'; '.join(bad)}")


def check_topology(cfg: ReferenceLMConfig, parallel: Any) -> None:
    ta, td, hidden = parallel.attention.tp_size, parallel.dense.tp_size, cfg.mlp_ratio * cfg.dim
    refuse("reference_lm", parallel, [(cfg.heads % ta == 0, f"heads={cfg.heads} % attention.tp={ta}"),
                                      (hidden % td == 0, f"hidden={hidden} % dense.tp={td}"),
                                      *decoder_rules(parallel)])


class Sampling(BaseModel):
    """How to continue prompts: the knobs every token plugin's request shares."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, le=1 << 20, description="Most tokens generated per prompt.")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0: greedy; otherwise sample at this temperature.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0: all).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Keep the smallest set with this probability mass.")
    seed: int = Field(0, ge=0, description="Seed of sampling; equal seeds give equal samples.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Generation of a prompt ends at any of these.")
    top_logprobs: int = Field(0, ge=0, le=20, description="Per token, report its k most likely tokens' log-probs.")

    def shared_payload(self, stop: list[int]) -> dict[str, Any]:
        """The part of every sequence's payload (`Slots.admit`) that is the same for all prompts of a request."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "stop_token_ids": stop, "top_logprobs": self.top_logprobs}


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
              [t for t in req.stop_token_ids if not 0 <= t < cfg.vocab]
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


def sequence_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt `index` of a request seeded `seed`; n copies of one prompt differ.

        sequence_seed(0, 1) == 1      sequence_seed(1, 0) == 0x9E3779B1      always in [0, 2**63)
    """
    return (seed * 0x9E3779B1 + index) % 2 ** 63
