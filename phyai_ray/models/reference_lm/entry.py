"""The `reference_lm` plugin entry.

    from phyai_ray import Engine, EngineArgs
    with Engine(EngineArgs(plugin="reference_lm", plugin_args={"seed": 0})) as engine:
        [out] = engine.step({"prompts": [[1, 2, 3]], "max_tokens": 8})   # TokenOutput

For the iteration protocol a request is one sequence per prompt (`sequences`), and its result is
the sequences' outputs in prompt order (`gather`).
"""

from __future__ import annotations

from typing import Any

from phyai_ray.llm.sampling import fresh_seed
from phyai_ray.models.reference_lm.config import GenerateRequest, ReferenceLMConfig, check_topology
from phyai_ray.models.reference_lm.model import ReferenceLM
from phyai_ray.outputs import TokenOutput
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.iteration import SequenceSpec
from phyai_ray.plugins.registry import register_plugin


@register_plugin
class ReferenceLMEntry(Entry):
    """Small causal transformer: dense + attention TP, KV cache, greedy and seeded sampling."""

    name = "reference_lm"
    parallel_domains = frozenset({"dense", "attention"})
    generates_tokens = True

    def __init__(self, plugin_args: dict[str, Any] | None = None) -> None:
        self.config = ReferenceLMConfig.from_args(plugin_args) if plugin_args is not None else ReferenceLMConfig()

    def configure(self, plugin_args: dict[str, Any] | None) -> None:
        self.config = ReferenceLMConfig.from_args(plugin_args)

    def validate_parallel(self, parallel: Any) -> None:
        check_topology(self.config, parallel)

    def max_sequence_tokens(self) -> int:
        return self.config.max_seq

    def validate_request(self, request: Any) -> Any:
        """None (run it as given), or the request with a fresh seed when it gave none: drawn here,
        once, so every rank samples alike and unseeded requests of one prompt differ."""
        req = GenerateRequest.parse(request, self.config)
        if req.seed is not None:
            return None
        return {**request, "seed": fresh_seed()} if isinstance(request, dict) else req.seeded()

    def sequences(self, request: Any) -> list[SequenceSpec]:
        """One sequence per prompt, seeded `sequence_seed(seed, i)` as `step` seeds it; costs its prompt length."""
        payloads = GenerateRequest.parse(request, self.config).payloads()
        return [SequenceSpec(payload=p, cost=len(p["prompt"]), steps=p["max_tokens"]) for p in payloads]

    def gather(self, request: Any, outputs: list[TokenOutput]) -> list[TokenOutput]:
        """The request's result: one `TokenOutput` per prompt, in prompt order (as `sequences` split it)."""
        return list(outputs)

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> ReferenceLM:
        return ReferenceLM(ReferenceLMConfig.from_args(plugin_args), ctx)
