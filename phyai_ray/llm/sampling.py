"""How to continue a prompt: the sampling knobs every token plugin's request shares, and per-prompt seeds.

    class GenerateRequest(Sampling):                  # a plugin's request adds its prompts
        prompts: list[list[int]]
    req.shared_payload(stop) | {"prompt": p, "seed": sequence_seed(req.seed, i)}   # one sequence each

A sequence payload is what `phyai_ray.llm.paged.PagedSequences.admit` takes; `sequence_seed` gives each
prompt of a request its own seed, so n copies of one prompt sample differently but reproducibly.

`seed` unset (None) means a fresh random seed, as vLLM and SGLang draw one: the dispatcher fixes it
once (`seeded()`, called by the plugins' `validate_request`), before any rank sees the request, so
tensor-parallel ranks sample alike and n unseeded requests of one prompt differ. A given seed stays
deterministic.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# what a sequence payload carries only when a request changes it (the processors of `phyai_ray.llm.logits`)
PROCESSOR_DEFAULTS = {"logit_bias": {}, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                      "repetition_penalty": 1.0, "min_p": 0.0}


class Sampling(BaseModel):
    """How to continue prompts: the knobs every token plugin's request shares."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, le=1 << 20, description="Most tokens generated per prompt.")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0: greedy; otherwise sample at this temperature.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0: all).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Keep the smallest set with this probability mass.")
    seed: int | None = Field(None, ge=0, description="Seed of sampling; equal seeds give equal samples. "
                                                       "Unset: a fresh random seed per request.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Generation of a prompt ends at any of these.")
    top_logprobs: int = Field(0, ge=0, le=20, description="Per token, report its k most likely tokens' log-probs.")
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=1024,
                                         description="Added to these token ids' logits before sampling (-100..100).")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted once from every token generated "
                                                                      "so far (vLLM / OpenAI).")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted per occurrence among the "
                                                                       "tokens generated so far.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="Tokens of the prompt or output: positive "
                                                                        "logits divided by it, negative multiplied.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Keep tokens at least min_p x the most likely one's "
                                                          "probability (after temperature).")

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[int, float]) -> dict[int, float]:
        bad = {k: v for k, v in bias.items() if not -100.0 <= v <= 100.0 or k < 0}
        if bad:
            raise ValueError(f"logit_bias values must lie in [-100, 100] for ids >= 0; got {dict(list(bad.items())[:4])}")
        return bias

    def seeded(self) -> "Sampling":
        """This request with its seed fixed: itself when it gave one, else a copy with a fresh random seed.

        Called once in the dispatcher (never on a rank: ranks drawing their own would sample apart)."""
        return self if self.seed is not None else self.model_copy(update={"seed": fresh_seed()})

    def shared_payload(self, stop: list[int]) -> dict[str, Any]:
        """The part of every sequence payload (`PagedSequences.admit`) shared by all prompts of a request."""
        changed = {k: getattr(self, k) for k, default in PROCESSOR_DEFAULTS.items() if getattr(self, k) != default}
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "stop_token_ids": stop, "top_logprobs": self.top_logprobs, **changed}


def fresh_seed() -> int:
    """A random request seed in [0, 2**31), from the OS's entropy (not the process's `random` state)."""
    return secrets.randbits(31)


def sequence_seed(seed: int | None, index: int) -> int:
    """The sampling seed of prompt `index` of a request seeded `seed`; n copies of one prompt differ.

        sequence_seed(0, 1) == 1      sequence_seed(1, 0) == 0x9E3779B1      always in [0, 2**63)

    A request that reaches here unseeded (`seeded()` was not called: a model's own `step` run on
    one rank) gets a fresh seed per sequence.
    """
    if seed is None:
        return secrets.randbits(63)
    return (seed * 0x9E3779B1 + index) % 2 ** 63
