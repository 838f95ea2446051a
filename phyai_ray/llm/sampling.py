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

from pydantic import BaseModel, ConfigDict, Field


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

    def seeded(self) -> "Sampling":
        """This request with its seed fixed: itself when it gave one, else a copy with a fresh random seed.

        Called once in the dispatcher (never on a rank: ranks drawing their own would sample apart)."""
        return self if self.seed is not None else self.model_copy(update={"seed": fresh_seed()})

    def shared_payload(self, stop: list[int]) -> dict[str, Any]:
        """The part of every sequence payload (`PagedSequences.admit`) shared by all prompts of a request."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "stop_token_ids": stop, "top_logprobs": self.top_logprobs}


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
