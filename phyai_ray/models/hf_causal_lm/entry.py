"""The `hf_causal_lm` plugin entry: a Hugging Face causal-LM folder served on the iteration protocol.

    from phyai_ray import Engine, EngineArgs
    with Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": "/models/Qwen2.5-0.5B"})) as engine:
        [out] = engine.step({"text": ["The capital of France is"], "max_tokens": 8})
        out.text, out.token_ids, out.log_probs

The entry runs in the dispatcher: it reads config.json and the safetensors headers (no weights)
to check the checkpoint and the topology before any rank starts, tokenizes text prompts, splits a
request into one sequence per prompt, and decodes the completions of a request that gave text.
"""

from __future__ import annotations

from typing import Any

from phyai_ray.llm.stops import cut_at_stop
from phyai_ray.models.hf_causal_lm.checkpoint import Architecture, Checkpoint, CheckpointError
from phyai_ray.models.hf_causal_lm.config import HFCausalLMConfig
from phyai_ray.models.hf_causal_lm.request import Parsed, TextRequest
from phyai_ray.models.hf_causal_lm.shards import ShardPlan, check_topology
from phyai_ray.outputs import TokenOutput
from phyai_ray.plugins.admission import KVBlocks, TokenBudget
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.iteration import SequenceSpec
from phyai_ray.plugins.registry import register_plugin

AFFINITY_TOKENS = 128  # the prompt's leading ids that name its replica under routing="affinity"


@register_plugin
class HFCausalLMEntry(Entry):
    """Llama, Qwen2, Qwen3 and Mistral checkpoints: dense + attention TP, continuous batching, text and chat."""

    name = "hf_causal_lm"
    parallel_domains = frozenset({"dense", "attention"})
    generates_tokens = True

    def __init__(self, plugin_args: dict[str, Any] | None = None) -> None:
        self.config: HFCausalLMConfig | None = None
        self.arch: Architecture | None = None
        self._codec: Any = None
        self.token_budget: int | None = None  # the deployment's, once `admission` is asked
        if plugin_args is not None:
            self.configure(plugin_args)

    def configure(self, plugin_args: dict[str, Any] | None) -> None:
        from pathlib import Path

        self.config = HFCausalLMConfig.from_args(plugin_args)
        folder = Path(self.config.model).expanduser()
        if not folder.is_dir():
            raise CheckpointError(f"model {self.config.model!r} is not a folder; hf_causal_lm reads a local "
                                  "checkpoint folder (config.json, *.safetensors, tokenizer.json) and never "
                                  "downloads one")
        ckpt = Checkpoint.open(folder, self.config.max_model_len)
        ckpt.check(ShardPlan(ckpt.arch).full_shapes())  # before any rank starts: headers only, no weights
        self.arch = ckpt.arch
        self.max_len = self.config.resolved_max_len(self.arch)
        self._codec = None
        _check_template(folder)

    def served_name(self) -> str:
        """The served model's name: the checkpoint folder's (OpenAI's `model`, OIP's model name)."""
        from pathlib import Path

        return Path(self._checked().model).expanduser().resolve().name

    @property
    def codec(self) -> Any:
        """The checkpoint's tokenizer and chat template (`TextCodec`), loaded on first use."""
        if self._codec is None:
            from phyai_ray.llm.tokenizer import TextCodec

            self._codec = TextCodec.open(self._checked().model)
        return self._codec

    def validate_parallel(self, parallel: Any) -> None:
        self._checked()
        check_topology(self.arch, parallel)

    def max_sequence_tokens(self) -> int:
        self._checked()
        return self.max_len

    def parse(self, request: Any) -> Parsed:
        self._checked()
        wants_text = isinstance(request, dict) and (request.get("text") is not None or bool(request.get("stop")))
        return TextRequest.parse(request, self.arch.vocab, self.max_len, self.arch.eos_ids,
                                 self.codec if wants_text else None)

    def validate_request(self, request: Any) -> Parsed:
        """The request checked and its text tokenized, once: what `sequences`, `gather` and the ranks
        receive. An unseeded request gets its fresh seed here, so every rank samples alike."""
        return self._parsed(request).seeded()

    def affinity_key(self, request: Any) -> tuple[int, ...]:
        """The first prompt's leading AFFINITY_TOKENS ids (routing="affinity"): the samples of one prompt, or
        requests behind one system prompt, go to the replica that holds its cached prefix."""
        prompts = self._parsed(request).prompts
        return tuple(prompts[0][:AFFINITY_TOKENS]) if prompts else ()

    def admission(self, batching: Any) -> KVBlocks:
        """vLLM's admission: up to max_num_seqs running, and a waiting sequence joins only when its prompt
        fits the ranks' free KV blocks and the iteration's token budget (`KVBlocks`), so it starts on the
        ranks at once. The budget is the one `HFCausalLMConfig.token_budget` resolves (a plugin_args value
        that disagrees with the deployment's is refused here, at start); every payload carries it."""
        self.token_budget = self._checked().token_budget(batching)
        return KVBlocks(TokenBudget(batching.max_num_seqs, self.token_budget))

    def sequences(self, request: Any) -> list[SequenceSpec]:
        budget = {"token_budget": self.token_budget} if self.token_budget is not None else {}
        return [SequenceSpec(payload={**p, **budget}, cost=len(p["prompt"]), steps=p["max_tokens"])
                for p in self._parsed(request).payloads()]

    def gather(self, request: Any, outputs: list[TokenOutput]) -> list[TokenOutput]:
        """One `TokenOutput` per prompt, in order; with `text` when the request gave text."""
        gave_text = request.gave_text if isinstance(request, Parsed) else \
            isinstance(request, dict) and request.get("text") is not None
        stops = request.request.stop if isinstance(request, Parsed) else \
            (request.get("stop") or []) if isinstance(request, dict) else []
        if gave_text:
            for out in outputs:
                out.text = cut_at_stop(self.codec.decode(out.token_ids), stops)
        return list(outputs)

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> Any:
        from phyai_ray.models.hf_causal_lm.model import HFCausalLM

        return HFCausalLM(HFCausalLMConfig.from_args(plugin_args), ctx)

    def _parsed(self, request: Any) -> Parsed:
        return request if isinstance(request, Parsed) else self.parse(request)

    def _checked(self) -> HFCausalLMConfig:
        if self.config is None:
            raise ValueError("hf_causal_lm needs plugin_args={'model': '/path/to/checkpoint-folder'}")
        return self.config


def _check_template(folder: Any) -> None:
    """The checkpoint's chat template compiles (before any rank starts); skipped without jinja2."""
    try:
        from phyai_ray.llm.tokenizer import check_template

        check_template(folder)
    except ImportError:
        return
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
