"""The token-plugin contract: what the OpenAI routes (`phyai_ray.serve.protocols.openai`) use of a plugin.

    entry = token_plugin(runner.entry)       # checked once, when the routes are mounted (TypeError
                                             # naming what is missing)
    if has_codec(entry):                     # text: the Entry's class has a `codec` property
        codec = tokenizer(entry.codec, entry)   # checked against Tokenizer (TypeError naming what it lacks)
    GenerationRequest(prompts=((1, 2),), n=2, max_tokens=8, ...).as_dict()   # the request the plugin receives

An `Entry` with `generates_tokens = True` gets /v1/completions and /v1/models. The routes read:

* `TokenPlugin`, of the Entry: `served_name()` (the `model` of /v1/models), `max_sequence_tokens()`
  (the longest prompt + completion, refused before anything is copied; None: no limit) and
  `validate_request(request)`, given a `GenerationRequest` as a dict (the form it returns runs).
* `codec`, optional: a property of the Entry's class giving a `Tokenizer` (`encode`, `decode`,
  `chat`). With it, prompts may be text, `stop` may hold strings, choices carry text and
  /v1/chat/completions is mounted; loading it may raise (a checkpoint without tokenizer.json), and
  text is then refused with that reason. Without it choices carry token ids only.
* what the plugin answers: a whole request, one `TokenResult` per sequence in order
  (`phyai_ray.outputs.TokenOutput` is one); a stream, the chunks of `phyai_ray.outputs.token_chunk`
  (`token_ids`, `log_probs`, and `top_logprobs` when asked), then those results.

`GenerationRequest.as_dict()` holds every prompt `n` times (n sequences of one request, one seed
for all: each sequence differs by its index); stop strings travel as `stop`, and the plugin ends a sequence
at the token that completes one. The logits processors (`logit_bias`, the penalties, `min_p`:
vLLM's definitions, `phyai_ray.llm.logits`) travel only when a request changes them, so a plugin
whose validator does not know them refuses such a request (a 400 naming the field) instead of
ignoring it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """Text in and out of a token plugin (`phyai_ray.llm.tokenizer.TextCodec` is one)."""

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, with the tokenizer's own special-token rule (its BOS)."""

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens left out; streamed text decodes a window of recent ids."""

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Ids of `messages` through the chat template; ValueError when the template refuses them."""


@runtime_checkable
class TokenPlugin(Protocol):
    """The Entry of a token plugin, as the OpenAI routes call it."""

    generates_tokens: bool

    def served_name(self) -> str:
        """The model's name on the protocols, unless the app sets `model_name`."""

    def max_sequence_tokens(self) -> int | None:
        """The longest prompt + completion the model takes; None when there is no such limit."""

    def validate_request(self, request: Any) -> Any:
        """Refuse a bad request (raise), or return the form to run (None: the request as it is)."""


class TokenResult(Protocol):
    """One sequence's result (`phyai_ray.outputs.TokenOutput` is one)."""

    token_ids: list[int]
    log_probs: list[float]  # one per token
    top_logprobs: list[dict[int, float]]  # per token {id: log-prob}; empty unless asked for
    stop_reason: str  # "completed" (a stop token or string) or "length"


@dataclass(frozen=True)
class GenerationRequest:
    """The request a token plugin receives from the OpenAI routes (`as_dict()`: the form it travels in)."""

    prompts: tuple[tuple[int, ...], ...]  # token ids of each prompt
    n: int  # sequences per prompt: the plugin receives each prompt n times, in order
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: only for a plugin with a `codec`
    top_logprobs: int = 0  # the k most likely alternatives of each token; 0: none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0

    def processors(self) -> dict[str, Any]:
        """The logits processors this request changes from their defaults (what `as_dict` adds)."""
        given = {"logit_bias": dict(self.logit_bias), "presence_penalty": self.presence_penalty,
                 "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                 "min_p": self.min_p}
        defaults = {"logit_bias": {}, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                    "min_p": 0.0}
        return {k: v for k, v in given.items() if v != defaults[k]}

    def as_dict(self) -> dict[str, Any]:
        """`stop`, `top_logprobs` and the processors appear only when given, so a plugin without them sees none."""
        copies = [ids for ids in map(list, self.prompts) for _ in range(self.n)]  # n references, one copy
        out: dict[str, Any] = {"prompts": copies, "max_tokens": self.max_tokens,
                               "temperature": self.temperature, "top_p": self.top_p,
                               "stop_token_ids": list(self.stop_token_ids), "seed": self.seed}
        if self.stop:
            out["stop"] = list(self.stop)
        out.update(self.processors())
        return {**out, "top_logprobs": self.top_logprobs} if self.top_logprobs else out


def token_plugin(entry: Any) -> TokenPlugin:
    """`entry` when it keeps the contract, else TypeError naming the plugin and what it lacks."""
    if not getattr(entry, "generates_tokens", False):
        raise TypeError(f"plugin {_name(entry)} does not set generates_tokens = True on its Entry; the OpenAI "
                        "routes serve token plugins only (phyai_ray.plugins.tokens.TokenPlugin)")
    missing = [m for m in ("served_name", "max_sequence_tokens", "validate_request")
               if not callable(getattr(entry, m, None))]
    if missing:
        raise TypeError(f"plugin {_name(entry)} sets generates_tokens but its Entry lacks {missing}; the OpenAI "
                        "routes call them (phyai_ray.plugins.tokens.TokenPlugin)")
    return entry


def has_codec(entry: Any) -> bool:
    """Whether the plugin offers text: a `codec` property on its Entry's class (seen without loading it)."""
    return hasattr(type(entry), "codec")


def tokenizer(codec: Any, entry: Any) -> Tokenizer:
    """`codec` (what `entry.codec` gave) when it is a `Tokenizer`, else TypeError naming what it lacks."""
    missing = [m for m in ("encode", "decode", "chat") if not callable(getattr(codec, m, None))]
    if missing:
        raise TypeError(f"the codec of plugin {_name(entry)} ({type(codec).__name__}) lacks {missing}; a token "
                        "plugin's codec needs encode, decode and chat (phyai_ray.plugins.tokens.Tokenizer)")
    return codec


def _name(entry: Any) -> str:
    return entry.display_name() if callable(getattr(entry, "display_name", None)) else type(entry).__name__
