"""Requests of `hf_causal_lm`: token ids or text, and how to continue them.

    {"prompts": [[1, 2, 3]], "max_tokens": 16}                     token ids, as reference_lm takes them
    {"text": ["Hello", "Bonjour"], "max_tokens": 16, "temperature": 0.7, "seed": 1}
                                                                   tokenized with the checkpoint's tokenizer
    knobs: temperature, top_k, top_p, seed (unset: a fresh random one per request), stop_token_ids,
           stop (strings: the token completing one is the last; the text omits it),
           ignore_eos (vLLM's name: keep going past EOS),
           top_logprobs (k: each token's k most likely alternatives in TokenOutput.top_logprobs),
           logit_bias, presence_penalty, frequency_penalty, repetition_penalty, min_p (vLLM's
           definitions: `phyai_ray.llm.logits`, `phyai_ray.llm.sampler`)

Generation of a prompt ends at the checkpoint's end-of-sequence ids (generation_config.json, else
config.json; a list allowed) unless `ignore_eos`, at any of `stop_token_ids`, at the token that
completes one of the `stop` strings (found on the ranks, `phyai_ray.llm.stops`), or at `max_tokens`.
A request that gave `text` gets `TokenOutput.text`, the completion decoded.
"""

from __future__ import annotations

from typing import Any

from typing import Annotated

from pydantic import Field, StringConstraints, ValidationError, model_validator

from phyai_ray.errors import RequestRejectedError
from phyai_ray.llm.sampling import Sampling, sequence_seed
from phyai_ray.llm.stops import MAX_STOP_CHARS


class MaxModelLenError(RequestRejectedError):
    """A prompt + max_tokens longer than the served length (plugin_args `max_model_len`): refused in the
    dispatcher, before any rank, as vLLM answers it (a 400 at the edges)."""

    def __init__(self, prompt: int, max_tokens: int, max_len: int) -> None:
        super().__init__(f"this model's maximum context length is max_model_len={max_len} tokens; the request "
                         f"asks for {prompt + max_tokens} ({prompt} in the longest prompt, {max_tokens} in "
                         "max_tokens): shorten the prompt, lower max_tokens, or serve with a larger plugin_args "
                         "'max_model_len' (up to the checkpoint's max_position_embeddings)",
                         plugin="hf_causal_lm", field="max_tokens")
        self.prompt, self.max_tokens, self.max_len = prompt, max_tokens, max_len

    def __reduce__(self):
        return (MaxModelLenError, (self.prompt, self.max_tokens, self.max_len))


class TextRequest(Sampling):
    """Prompts as token ids (`prompts`) or strings (`text`), and the sampling parameters (`Sampling`)."""

    prompts: list[list[int]] | None = Field(None, min_length=1, max_length=1024, description="Prompt token ids.")
    text: list[str] | str | None = Field(None, description="Prompt strings, tokenized with the checkpoint's tokenizer.")
    ignore_eos: bool = Field(False, description="Do not stop at the end-of-sequence ids.")
    stop: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=16, description="Stop strings: generation ends at the token completing one.")

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> "TextRequest":
        if (self.prompts is None) == (self.text is None):
            raise ValueError("give exactly one of `prompts` (token id lists) or `text` (strings)")
        if isinstance(self.text, list) and not 1 <= len(self.text) <= 1024:
            raise ValueError(f"`text` holds {len(self.text)} strings; give 1 to 1024")
        return self

    @property
    def texts(self) -> list[str] | None:
        return [self.text] if isinstance(self.text, str) else self.text

    @classmethod
    def parse(cls, request: Any, vocab: int, max_len: int, eos: tuple[int, ...], codec: Any = None) -> "Parsed":
        try:
            req = cls.model_validate(request)
        except ValidationError as exc:
            raise ValueError(f"hf_causal_lm request: {exc}") from None
        if (req.texts is not None or req.stop) and codec is None:
            raise ValueError(f"hf_causal_lm request: `{'text' if req.texts is not None else 'stop'}` needs the "
                             "checkpoint's tokenizer, which this model does not have; send token ids in `prompts` "
                             "and `stop_token_ids`")
        prompts = req.prompts if req.texts is None else [codec.encode(t) for t in req.texts]
        bad = [t for p in prompts for t in p if not 0 <= t < vocab] + \
              [t for t in req.stop_token_ids if not 0 <= t < vocab] + \
              [t for t in req.logit_bias if not 0 <= t < vocab]
        if bad or any(not p for p in prompts):
            raise ValueError(f"hf_causal_lm request: prompts must be non-empty and every id in [0, {vocab}); got "
                             f"{'an empty prompt' if not bad else f'out-of-range ids {bad[:5]}'}")
        longest = max(len(p) for p in prompts)
        if longest + req.max_tokens > max_len:
            raise MaxModelLenError(longest, req.max_tokens, max_len)
        return Parsed(req, [list(p) for p in prompts], () if req.ignore_eos else eos)


class Parsed:
    """A checked request with its prompts as ids: what `PagedDecoder.generate` and the entry use."""

    def __init__(self, request: TextRequest, prompts: list[list[int]], eos: tuple[int, ...]) -> None:
        self.request, self.prompts, self.eos = request, prompts, eos
        self.max_tokens = request.max_tokens

    @property
    def gave_text(self) -> bool:
        return self.request.texts is not None

    def seeded(self) -> "Parsed":
        """This request with its seed fixed (`Sampling.seeded`): a fresh random one when it gave none."""
        request = self.request.seeded()
        return self if request is self.request else Parsed(request, self.prompts, self.eos)

    def payloads(self) -> list[dict[str, Any]]:
        """One sequence payload per prompt (what `PagedSequences.admit` takes), seeded by `sequence_seed`."""
        r = self.request
        shared = r.shared_payload(sorted(set(r.stop_token_ids) | set(self.eos)))
        if r.stop:
            shared["stop_strings"] = list(r.stop)
        return [{"prompt": p, **shared, "seed": sequence_seed(r.seed, i)} for i, p in enumerate(self.prompts)]
