"""OpenAI-compatible routes for token plugins (`Entry.generates_tokens = True`: reference_lm, hf_causal_lm).

    POST /v1/completions        prompt as text or token ids (one, or a list); max_tokens, temperature,
                                top_p, seed, stop (strings, or token ids), logprobs, n, stream
    POST /v1/chat/completions   messages through the checkpoint's chat template (`serve/openai_chat.py`)
    GET  /v1/models             one model: `--model-name`, else the plugin's (hf_causal_lm: the folder's name)

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)
    out = client.completions.create(model="Qwen2.5-0.5B", prompt="Once upon", max_tokens=8, logprobs=1)
    out.choices[0].text, out.choices[0].token_ids, out.choices[0].logprobs.token_logprobs

Text needs a plugin with a tokenizer (`hf_causal_lm`); for the others a text prompt is refused
(400) and `text` is empty: every choice carries `token_ids`, and `logprobs.tokens` names tokens as
"token_id:<id>" (vLLM's convention) unless a tokenizer gives their text. `stream=true` answers
with server-sent events, one chunk per generated token and choice, then `data: [DONE]`; a client
that disconnects stops the generation on every rank. Errors use OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with the statuses of `serve/errors.py`; the API
key (bearer) is the app's own.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, StreamingResponse

from phyai_ray.outputs import entry_values
from phyai_ray.serve.errors import classify
from phyai_ray.serve.openai_text import (ChoiceText, cut_at_stop, encode_prompts, require, stop_lists, text_codec,
                                        usable)

MAX_COPIED_TOKENS = 1 << 22  # prompt ids x n one request may expand to (the plugin request holds n copies)


class CompletionRequest(BaseModel):
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


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.headers = status, type, param, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


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
    return generation_request([list(p) for p in _prompts(body)], n=body.n, max_tokens=body.max_tokens,
                              temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop_ids=stop_ids,
                              top_logprobs=body.logprobs or 0)


def generation_request(prompts: list[list[int]], *, n: int, max_tokens: int, temperature: float, top_p: float,
                       seed: int | None, stop_ids: list[int], top_logprobs: int = 0) -> dict[str, Any]:
    """The token plugins' request: every prompt n times (n sequences), one seed for all (each differs by index)."""
    out = {"prompts": [p for p in prompts for _ in range(n)], "max_tokens": max_tokens, "temperature": temperature,
           "top_p": top_p, "stop_token_ids": list(stop_ids),
           "seed": seed if seed is not None else random.randrange(2 ** 31)}
    return {**out, "top_logprobs": top_logprobs} if top_logprobs else out


def add_openai_routes(api: FastAPI, runner: Any, options: Any = None) -> None:
    """Mount /v1/completions and /v1/models for a token plugin on `api` (behind its key and limits);
    `options` (ServeOptions; None: the defaults) gives the model name, `overload_status` and
    `stream_interval` (streamed completions write at most one event per that many token steps)."""
    from phyai_ray.serve.options import ServeOptions

    options = options if options is not None else ServeOptions()
    name = options.model_name or runner.entry.served_name()
    stream_interval, overloaded = options.stream_interval, options.overload_status

    @api.get("/v1/models", tags=["openai"], summary="The served model (OpenAI-compatible)")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "phyai-ray"}]}

    @api.post("/v1/completions", tags=["openai"], summary="Completions (OpenAI-compatible, token ids)")
    async def completions(body: dict[str, Any]) -> Any:
        try:  # parsing, size checks, the n copies and the plugin's validator: off the event loop
            request, plugin = await asyncio.to_thread(_prepare, runner, body, name)
            codec = usable(text_codec(runner.entry))
            if request.stream:
                chunks = CompletionChunks(request, name, codec, len(plugin["prompts"]))
                return StreamingResponse(sse(runner, plugin, chunks, stream_interval, overloaded),
                                         media_type="text/event-stream")
            outputs = await _generate(runner, plugin)
            return JSONResponse(_completion(outputs, request, name, codec))
        except Exception as exc:  # a bad body, engine errors: OpenAI's shape, the failure table's status
            return openai_error(exc, overload_status=overloaded).response()

    if hasattr(type(runner.entry), "codec"):  # a plugin with a tokenizer and chat template
        from phyai_ray.serve.openai_chat import add_chat_route

        add_chat_route(api, runner, name, stream_interval=stream_interval, overload_status=overloaded)


def _prepare(runner: Any, body: dict[str, Any], name: str) -> tuple[CompletionRequest, dict[str, Any]]:
    """The validated OpenAI request and the plugin's request for it; sizes are checked before any copy."""
    request = CompletionRequest.model_validate(body)
    if request.model not in (None, name):
        raise OpenAIError(404, f"model {request.model!r} is not served here; GET /v1/models lists {name!r}",
                          type="not_found_error", param="model")
    codec = text_codec(runner.entry)
    if any(isinstance(p, str) for p in _prompts(request)):
        request = request.model_copy(update={"prompt": encode_prompts(codec, _prompts(request))})
    check_sizes(request, runner.entry.max_sequence_tokens())
    plugin = plugin_request(request, codec)
    try:
        runner.entry.validate_request(plugin)
    except Exception as exc:
        raise OpenAIError(400, f"the model rejected the request: {exc}") from None
    return request, plugin


async def _generate(runner: Any, plugin: dict[str, Any]) -> list:
    return await runner.run(plugin, validate=False)


def finish_reason(out: Any, stopped: bool = False) -> str:
    return "stop" if stopped else {"completed": "stop", "length": "length"}.get(out.stop_reason, "stop")


def _choice(index: int, out: Any, want_logprobs: bool, codec: Any, stops: list[str]) -> dict[str, Any]:
    text, stopped = cut_at_stop(codec.decode(out.token_ids), stops) if codec is not None else ("", False)
    return {"index": index, "text": text, "token_ids": out.token_ids, "finish_reason": finish_reason(out, stopped),
            "logprobs": _logprobs(out.token_ids, out.log_probs, codec, out.top_logprobs) if want_logprobs else None}


def token_text(codec: Any, token: int) -> str:
    """A token as OpenAI's logprobs name it: its text with a tokenizer, else "token_id:<id>" (vLLM's convention)."""
    return codec.decode([token]) if codec is not None else f"token_id:{token}"


def _logprobs(ids: list[int], lps: list[float], codec: Any = None, tops: list | None = None) -> dict[str, Any]:
    top = [{token_text(codec, t): lp for t, lp in alt.items()} for alt in tops] if tops else None
    return {"tokens": [token_text(codec, t) for t in ids], "token_logprobs": list(lps), "top_logprobs": top,
            "text_offset": [0] * len(ids)}


def _completion(outputs: list, request: CompletionRequest, name: str, codec: Any = None) -> dict[str, Any]:
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

    def __init__(self, request: CompletionRequest, name: str, codec: Any, choices: int) -> None:
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

    def end(self, outputs: list) -> list[dict[str, Any]]:
        choices = []
        for b, out in enumerate(outputs):
            rest = self.texts[b].push([], final=True) if self.texts is not None else ""
            stopped = self.texts is not None and self.texts[b].stopped
            choices.append({"index": b, "text": rest, "token_ids": [], "finish_reason": finish_reason(out, stopped),
                            "logprobs": None})
        return [{**self.head, "choices": choices}]


async def sse(runner: Any, plugin: dict[str, Any], chunks: Any, interval: int = 1,
              overload_status: int = 503) -> AsyncIterator[str]:
    """Server-sent events of one streamed generation, rendered by `chunks` (`tokens`, `end`, `finished`);
    leaving early (disconnect), or every choice stopping, cancels the generation.

    One write carries every event waiting; after the first token (written at once) a write waits
    until `interval` token steps are there, or the stream ended."""
    items, final = runner.stream(plugin), []  # forwarded when this group failed; open as a session meanwhile
    try:
        ended, events, steps, written = False, [], 0, False
        async for ready in items:
            for kind, value in ready:
                if kind == "error":
                    if events:
                        yield "".join(events)
                    raise value
                if kind == "end":
                    final, ended = value or [], True
                    break
                tops = value.get("top_logprobs") or [None] * len(value["token_ids"])
                step = [(b, entry_values(t), entry_values(lp), top) for b, (t, lp, top)
                        in enumerate(zip(value["token_ids"], value["log_probs"], tops)) if t is not None]
                rendered = chunks.tokens(step)
                events += [f"data: {json.dumps(e)}\n\n" for e in rendered]
                steps += bool(rendered)
                if chunks.finished:
                    final, ended = [_Stopped()] * len(value["token_ids"]), True
                    break
            if events and (ended or not written or steps >= interval):  # one message through the proxy
                yield "".join(events)
                events, steps, written = [], 0, True
            if ended:
                break
        yield "".join(f"data: {json.dumps(e)}\n\n" for e in chunks.end(final))
    except Exception as exc:  # headers are sent: the error travels as an event in OpenAI's shape
        error = openai_error(exc, overload_status=overload_status)
        shape = {'message': str(error), 'type': error.type, 'code': error.status}
        yield f"data: {json.dumps({'error': shape})}\n\n"
    finally:
        await items.aclose()  # never blocks; the stream is cancelled at its next iteration (or chunk)
    yield "data: [DONE]\n\n"


class _Stopped:
    """The output of a choice that a stop string ended (its generation was cancelled)."""

    stop_reason = "completed"


OPENAI_TYPES = {"overloaded": "overloaded_error", "timeout": "timeout_error"}  # every other server kind: server_error


def openai_error(exc: Exception, *, overload_status: int = 503) -> OpenAIError:
    """`exc` in OpenAI's error shape: a bad body is 400, anything else has its row of the failure table."""
    from pydantic import ValidationError

    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return OpenAIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                           param=str(first["loc"][0]) if first["loc"] else None)
    failure = classify(exc, overload_status=overload_status)
    kind = OPENAI_TYPES.get(failure.kind, "server_error" if failure.status >= 500 else "invalid_request_error")
    return OpenAIError(failure.status, failure.message, type=kind, headers=failure.headers)
