"""How to continue a prompt: the sampling knobs every token plugin's request shares, and per-prompt seeds.

    class GenerateRequest(Sampling):                  # a plugin's request adds its prompts
        prompts: list[list[int]]
    req.shared_payload(stop) | {"prompt": p, "seed": sequence_seed(req.seed, i)}   # one sequence each

A sequence payload is what `phyai_ray.llm.slots.Slots.admit` takes; `sequence_seed` gives each
prompt of a request its own seed, so n copies of one prompt sample differently but reproducibly.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


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


def sequence_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt `index` of a request seeded `seed`; n copies of one prompt differ.

        sequence_seed(0, 1) == 1      sequence_seed(1, 0) == 0x9E3779B1      always in [0, 2**63)
    """
    return (seed * 0x9E3779B1 + index) % 2 ** 63
