"""OpenAI-compatible routes for token plugins (`Entry.generates_tokens = True`: reference_lm, hf_causal_lm).

    POST /v1/completions        prompt as text or token ids (one, or a list); max_tokens, temperature,
                                top_p, seed, stop (strings, or token ids), logprobs, n, stream;
                                deadline_ms (an extension) or X-Request-Deadline-Ms (common.py)
    POST /v1/chat/completions   messages through the checkpoint's chat template (`serve/protocols/openai/chat.py`)
    GET  /v1/models             one model: `--model-name`, else the plugin's (hf_causal_lm: the folder's name)

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)
    out = client.completions.create(model="Qwen2.5-0.5B", prompt="Once upon", max_tokens=8, logprobs=1)
    out.choices[0].text, out.choices[0].token_ids, out.choices[0].logprobs.token_logprobs

Text needs a plugin with a tokenizer (`hf_causal_lm`); for the others a text prompt is refused
(400) and `text` is empty: every choice carries `token_ids`, and `logprobs.tokens` names tokens as
"token_id:<id>" (vLLM's convention) unless a tokenizer gives their text. `stream=true` answers
with server-sent events, one chunk per generated token and choice, then `data: [DONE]`; a client
that disconnects stops the generation on every rank. Errors use OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with the statuses of `serve/protocols/error_map.py`
(`common.py`); the API key (bearer) is the app's own. The request is validated once, by
the plugin's validator here, and runs in the form it returned. What the routes read of the plugin
(its Entry, tokenizer, results) is declared in `phyai_ray.plugins.tokens`, and checked when they
are mounted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ConfigDict, Field
from starlette.responses import JSONResponse, StreamingResponse

from phyai_ray.plugins.tokens import TokenResult, Tokenizer, has_codec, token_plugin
from phyai_ray.serve.protocols.openai.chat import add_chat_route
from phyai_ray.serve.protocols.openai.common import (OpenAIError, ProcessorFields, RequestDeadline, finish_reason,
                                                    generation_request, openai_error, sse)
from phyai_ray.serve.protocols.openai.text import (ChoiceText, cut_at_stop, encode_prompts, require, stop_lists,
                                                  text_codec, usable)
from phyai_ray.serve.protocols.timing import DEADLINE_HEADER
from phyai_ray.serve.runtime.options import ServeOptions
from phyai_ray.validation import Validated, validate

MAX_COPIED_TOKENS = 1 << 22  # prompt ids x n one request may expand to (the plugin request holds n copies)


class CompletionRequest(ProcessorFields):
    """The fields of OpenAI's completions request this server honours (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    stop: list[int] | int | str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False


def _prompts(body: CompletionRequest) -> list:
    return body.prompt if body.prompt and isinstance(body.prompt[0], list) else [body.prompt]


def check_sizes(body: CompletionRequest, limit: int | None) -> None:
    """Refuse a request too long for the model (`limit`: its longest prompt + completion) or one
    that `n` would expand beyond `MAX_COPIED_TOKENS`, before anything is copied."""
    prompts = _prompts(body)
    longest = max((len(p) for p in prompts), default=0)
    if limit is not None and longest + body.max_tokens > limit:
        raise OpenAIError(400, f"the longest prompt ({longest} ids) + max_tokens ({body.max_tokens}) = "
                               f"{longest + body.max_tokens} exceeds the model's {limit} tokens; shorten the prompt "
                               "or lower max_tokens", param="prompt" if longest >= limit else "max_tokens")
    total = sum(len(p) for p in prompts)
    if total * body.n > MAX_COPIED_TOKENS:
        raise OpenAIError(400, f"n ({body.n}) x prompt ids ({len(prompts)} prompt(s), longest {longest}: {total}) = "
                               f"{total * body.n} exceeds {MAX_COPIED_TOKENS}; lower n or send fewer prompts",
                          param="n")


def plugin_request(body: CompletionRequest, codec: Any = None) -> dict[str, Any]:
    """The plugin's request for an OpenAI body whose prompts are token ids (`encode_prompts` made them so)."""
    stop_ids, stop_strings = stop_lists(body.stop)
    if stop_strings:
        require(codec, "a stop string")
    return generation_request(_prompts(body), n=body.n, max_tokens=body.max_tokens,
                              temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop_ids=stop_ids,
                              top_logprobs=body.logprobs or 0, stop_strings=stop_strings, **body.processors())


def add_openai_routes(api: FastAPI, runner: Any, options: Any = None) -> None:
    """Mount /v1/completions and /v1/models for a token plugin on `api` (behind its key and limits);
    `options` (ServeOptions; None: the defaults) gives the model name, `overload_status` and
    `stream_interval` (streamed completions write at most one event per that many token steps).
    The plugin must keep `phyai_ray.plugins.tokens.TokenPlugin` (TypeError naming what it lacks)."""
    options = options if options is not None else ServeOptions()
    entry = token_plugin(runner.entry)
    name = options.model_name or entry.served_name()
    stream_interval, overloaded = options.stream_interval, options.overload_status

    @api.get("/v1/models", tags=["openai"], summary="The served model (OpenAI-compatible)")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "phyai-ray"}]}

    @api.post("/v1/completions", tags=["openai"], summary="Completions (OpenAI-compatible, token ids)")
    async def completions(body: dict[str, Any], http: Request) -> Any:
        try:  # parsing, size checks, the n copies and the plugin's validator (once): off the event loop
            deadline = RequestDeadline(http.headers.get(DEADLINE_HEADER), body.get("deadline_ms"))
            request, checked, choices = await asyncio.to_thread(_prepare, runner, body, name)
            codec = usable(text_codec(runner.entry))
            if request.stream:
                chunks = CompletionChunks(request, name, codec, choices)
                return StreamingResponse(sse(runner, checked, chunks, stream_interval, overloaded, deadline),
                                         media_type="text/event-stream")
            outputs = await runner.run(checked, deadline_s=deadline.left())
            return JSONResponse(_completion(outputs, request, name, codec))
        except Exception as exc:  # a bad body, engine errors: OpenAI's shape, the failure table's status
            return openai_error(exc, overload_status=overloaded).response()

    if has_codec(entry):  # a plugin with a tokenizer and chat template
        add_chat_route(api, runner, name, stream_interval=stream_interval, overload_status=overloaded)


def _prepare(runner: Any, body: dict[str, Any], name: str) -> tuple[CompletionRequest, Validated, int]:
    """The OpenAI request, the plugin's request for it (validated) and its number of choices; sizes are
    checked before any copy."""
    request = CompletionRequest.model_validate(body)
    if request.model not in (None, name):
        raise OpenAIError(404, f"model {request.model!r} is not served here; GET /v1/models lists {name!r}",
                          type="not_found_error", param="model")
    codec = text_codec(runner.entry)
    if any(isinstance(p, str) for p in _prompts(request)):
        request = request.model_copy(update={"prompt": encode_prompts(codec, _prompts(request))})
    field = request.unsupported_sampling()
    if field is not None:
        raise OpenAIError(400, f"{field} is not supported by this server (it would change what is returned); "
                               "leave it out", param=field)
    check_sizes(request, token_plugin(runner.entry).max_sequence_tokens())
    plugin = plugin_request(request, codec)
    return request, validate(runner.entry, plugin), len(plugin["prompts"])


def _choice(index: int, out: TokenResult, want_logprobs: bool, codec: Tokenizer | None,
            stops: list[str]) -> dict[str, Any]:
    text, stopped = cut_at_stop(codec.decode(out.token_ids), stops) if codec is not None else ("", False)
    return {"index": index, "text": text, "token_ids": out.token_ids, "finish_reason": finish_reason(out, stopped),
            "logprobs": _logprobs(out.token_ids, out.log_probs, codec, out.top_logprobs) if want_logprobs else None}


def token_text(codec: Tokenizer | None, token: int) -> str:
    """A token as OpenAI's logprobs name it: its text with a tokenizer, else "token_id:<id>" (vLLM's convention)."""
    return codec.decode([token]) if codec is not None else f"token_id:{token}"


def _logprobs(ids: list[int], lps: list[float], codec: Tokenizer | None = None,
              tops: list | None = None) -> dict[str, Any]:
    top = [{token_text(codec, t): lp for t, lp in alt.items()} for alt in tops] if tops else None
    return {"tokens": [token_text(codec, t) for t in ids], "token_logprobs": list(lps), "top_logprobs": top,
            "text_offset": [0] * len(ids)}


def _completion(outputs: list[TokenResult], request: CompletionRequest, name: str,
                codec: Tokenizer | None = None) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in _prompts(request)) * request.n
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    stops = stop_lists(request.stop)[1]
    choices = [_choice(i, o, request.logprobs is not None, codec, stops) for i, o in enumerate(outputs)]
    return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


class CompletionChunks:
    """The events of a streamed completion: one chunk per choice with new tokens, then the finish chunk."""

    def __init__(self, request: CompletionRequest, name: str, codec: Tokenizer | None, choices: int) -> None:
        self.head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                     "model": name}
        self.want_lp, self.codec = request.logprobs is not None, codec
        stops = stop_lists(request.stop)[1]
        self.texts = [ChoiceText(codec, stops) for _ in range(choices)] if codec is not None else None

    @property
    def finished(self) -> bool:
        """Every choice met a stop string: the generation can be cancelled."""
        return self.texts is not None and all(t.stopped for t in self.texts)

    def tokens(self, ready: list[tuple[int, list[int], list[float], list | None]]) -> list[dict[str, Any]]:
        choices = []
        for b, ids, lps, tops in ready:
            if self.texts is not None and self.texts[b].stopped:
                continue
            text = self.texts[b].push(ids) if self.texts is not None else ""
            choices.append({"index": b, "text": text, "token_ids": ids, "finish_reason": None,
                            "logprobs": _logprobs(ids, lps, self.codec, tops) if self.want_lp else None})
        return [{**self.head, "choices": choices}] if choices else []

    def end(self, outputs: list[TokenResult]) -> list[dict[str, Any]]:
        choices = []
        for b, out in enumerate(outputs):
            rest = self.texts[b].push([], final=True) if self.texts is not None else ""
            stopped = self.texts is not None and self.texts[b].stopped
            choices.append({"index": b, "text": rest, "token_ids": [], "finish_reason": finish_reason(out, stopped),
                            "logprobs": None})
        return [{**self.head, "choices": choices}]


