"""OpenAI's `/v1/chat/completions` for token plugins with a tokenizer and chat template (`hf_causal_lm`).

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)
    out = client.chat.completions.create(model="Qwen2.5-0.5B-Instruct", max_tokens=32,
                                         messages=[{"role": "user", "content": "Hi"}])
    out.choices[0].message.content
    for chunk in client.chat.completions.create(..., stream=True):   # chat.completion.chunk events
        chunk.choices[0].delta.content

The messages go through the checkpoint's chat template with `add_generation_prompt`, are
tokenized without adding special tokens again, and run as `n` sequences of one request. Honoured:
max_tokens / max_completion_tokens, temperature, top_p, seed, stop (strings), n (at most MAX_N),
logprobs with top_logprobs (each token's log-probability and its k most likely alternatives),
logit_bias, presence / frequency / repetition penalties and min_p (`common.ProcessorFields`),
stream, chat_template_kwargs (more template variables), deadline_ms (an extension; or the
X-Request-Deadline-Ms header: see common.py). Content as text parts is joined into one
string. Bad input (no messages, an unknown role, a message without content, a template that refuses
the chat, messages over max_model_len x CHARS_PER_TOKEN characters, a prompt longer than the model
takes) is a 400 in OpenAI's error shape, and so is any of tools, tool_choice, functions,
response_format or prompt_logprobs: not implemented, so never ignored.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ConfigDict, Field
from starlette.responses import JSONResponse, StreamingResponse

from phyai_ray.plugins.tokens import TokenResult, Tokenizer, token_plugin
from phyai_ray.serve.protocols.openai.common import (OpenAIError, ProcessorFields, RequestDeadline, finish_reason,
                                                    generation_request, openai_error, sse)
from phyai_ray.serve.protocols.openai.text import ChoiceText, cut_at_stop, require, stop_lists, text_codec
from phyai_ray.serve.protocols.timing import DEADLINE_HEADER
from phyai_ray.validation import Validated, validate

MAX_N = 16
CHARS_PER_TOKEN = 32  # messages longer than max_model_len * this are refused before tokenizing


class ChatRequest(ProcessorFields):
    """The fields of OpenAI's chat completions request this server honours (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template
    # fields that change what is generated and are not implemented: refused (400 naming the field), never ignored
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None

    def unsupported(self) -> str | None:
        """The first field given that this server does not implement (None: all honoured)."""
        for field in ("tools", "tool_choice", "functions", "response_format"):
            if getattr(self, field) not in (None, [], {}):
                return field
        return self.unsupported_sampling()

    def limit(self, room: int) -> int:
        """max_completion_tokens, else max_tokens, else what the model has room for (at most 4096)."""
        return self.max_completion_tokens or self.max_tokens or max(1, min(room, 4096))


def add_chat_route(api: FastAPI, runner: Any, name: str, *, stream_interval: int = 1,
                   overload_status: int = 503) -> None:
    @api.post("/v1/chat/completions", tags=["openai"], summary="Chat completions (OpenAI-compatible)")
    async def chat(body: dict[str, Any], http: Request) -> Any:
        try:  # template, tokenization and checks (the plugin's validator once) off the event loop
            deadline = RequestDeadline(http.headers.get(DEADLINE_HEADER), body.get("deadline_ms"))
            request, checked, codec, prompt_tokens = await asyncio.to_thread(_prepare, runner, body, name)
            if request.stream:
                chunks = ChatChunks(request, name, codec, request.n)
                return StreamingResponse(sse(runner, checked, chunks, stream_interval, overload_status, deadline),
                                         media_type="text/event-stream")
            outputs = await runner.run(checked, deadline_s=deadline.left())
            return JSONResponse(_response(outputs, request, name, codec, prompt_tokens))
        except Exception as exc:
            return openai_error(exc, overload_status=overload_status).response()


def _prepare(runner: Any, body: dict[str, Any], name: str) -> tuple[ChatRequest, Validated, Tokenizer, int]:
    """The chat request, the plugin's request for it (validated), the codec and the prompt's length in tokens."""
    request = ChatRequest.model_validate(body)
    if request.model not in (None, name):
        raise OpenAIError(404, f"model {request.model!r} is not served here; GET /v1/models lists {name!r}",
                          type="not_found_error", param="model")
    if request.top_logprobs and not request.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    field = request.unsupported()
    if field is not None:
        raise OpenAIError(400, f"{field} is not supported by this server (it would change what is generated); "
                               "leave it out", param=field)
    reserved = {"messages", "add_generation_prompt"} & set(request.chat_template_kwargs or {})
    if reserved:
        raise OpenAIError(400, f"chat_template_kwargs may not set {sorted(reserved)}; the request's own fields do",
                          param="chat_template_kwargs")
    codec = require(text_codec(runner.entry), "a chat")
    limit = token_plugin(runner.entry).max_sequence_tokens()
    chars = sum(len(json.dumps(m.get("content"), ensure_ascii=False)) for m in request.messages
                if isinstance(m, dict))
    if chars > limit * CHARS_PER_TOKEN:
        raise OpenAIError(400, f"the messages hold {chars} characters; the model takes {limit} tokens, so at most "
                               f"{limit * CHARS_PER_TOKEN} characters are tokenized: shorten the messages",
                          param="messages")
    try:
        prompt = codec.chat(request.messages, add_generation_prompt=True, **(request.chat_template_kwargs or {}))
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="messages") from None
    if len(prompt) >= limit:
        raise OpenAIError(400, f"the chat is {len(prompt)} tokens after its template; the model takes {limit} "
                               "(prompt + completion): shorten the messages", param="messages")
    max_tokens = request.limit(limit - len(prompt))
    if len(prompt) + max_tokens > limit:
        raise OpenAIError(400, f"the chat ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                               f"{limit} tokens; lower max_tokens", param="max_tokens")
    plugin = generation_request([prompt], n=request.n, max_tokens=max_tokens, temperature=request.temperature,
                                top_p=request.top_p, seed=request.seed, stop_ids=[],
                                top_logprobs=request.top_logprobs or 0, stop_strings=stop_lists(request.stop)[1],
                                **request.processors())
    return request, validate(runner.entry, plugin), codec, len(prompt)


def _entry(codec: Tokenizer, token: int, lp: float) -> dict[str, Any]:
    text = codec.decode([token])
    return {"token": text, "logprob": lp, "bytes": list(text.encode())}


def _token_logprobs(codec: Tokenizer, ids: list[int], lps: list[float], tops: list | None = None) -> dict[str, Any]:
    tops = tops or [{}] * len(ids)
    return {"content": [{**_entry(codec, t, lp), "top_logprobs": [_entry(codec, a, alp) for a, alp in top.items()]}
                        for t, lp, top in zip(ids, lps, tops)]}


def _response(outputs: list[TokenResult], request: ChatRequest, name: str, codec: Tokenizer,
              prompt_tokens: int) -> dict[str, Any]:
    stops = stop_lists(request.stop)[1]
    choices = []
    for i, out in enumerate(outputs):
        text, stopped = cut_at_stop(codec.decode(out.token_ids), stops)
        choices.append({"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": (_token_logprobs(codec, out.token_ids, out.log_probs, out.top_logprobs)
                                     if request.logprobs else None),
                        "finish_reason": finish_reason(out, stopped)})
    completion = sum(len(o.token_ids) for o in outputs)
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}


class ChatChunks:
    """`chat.completion.chunk` events: the role first, then content deltas, then each choice's finish."""

    def __init__(self, request: ChatRequest, name: str, codec: Tokenizer, choices: int) -> None:
        self.head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": name}
        self.codec, self.want_lp = codec, request.logprobs
        stops = stop_lists(request.stop)[1]
        self.texts = [ChoiceText(codec, stops) for _ in range(choices)]
        self.started = [False] * choices

    @property
    def finished(self) -> bool:
        return all(t.stopped for t in self.texts)

    def tokens(self, ready: list[tuple[int, list[int], list[float], list | None]]) -> list[dict[str, Any]]:
        events = []
        for b, ids, lps, tops in ready:
            if self.texts[b].stopped:
                continue
            delta: dict[str, Any] = {"content": self.texts[b].push(ids)}
            if not self.started[b]:
                delta, self.started[b] = {"role": "assistant", **delta}, True
            logprobs = _token_logprobs(self.codec, ids, lps, tops) if self.want_lp else None
            events.append({**self.head, "choices": [{"index": b, "delta": delta, "logprobs": logprobs,
                                                     "finish_reason": None}]})
        return events

    def end(self, outputs: list[TokenResult]) -> list[dict[str, Any]]:
        events = []
        for b, out in enumerate(outputs):
            rest = self.texts[b].push([], final=True)
            delta = {"content": rest} if rest else {}
            events.append({**self.head, "choices": [{"index": b, "delta": delta, "logprobs": None,
                                                     "finish_reason": finish_reason(out, self.texts[b].stopped)}]})
        return events
