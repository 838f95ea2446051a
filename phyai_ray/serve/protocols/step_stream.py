"""`POST /v1/step/stream`: the JSON route's streamed form, one JSON object per line (NDJSON).

    curl -N localhost:8000/v1/step/stream -d '{"prompt": "a red cube", "num_inference_steps": 3}'
    {"step": 1, "of": 3}
    {"step": 2, "of": 3}
    {"step": 3, "of": 3}
    {"video": {"__tensor__": {"dtype": "uint8", "shape": [9, 32, 32, 3], "data": "..."}}}

The body is what `/v1/step` takes (tensors in the codec's encoding, `serve/protocols/codec.py`) and is
validated the same way, once. Each line is one chunk of the request's stream as the plugin gives
it, in the same encoding: a diffusion plugin's progress reports (`{"step": i, "of": n}`; when the
reader lags, only the latest is kept) then its result; a token plugin's token chunks. The stream's
final result is written as one more line unless the plugin's last chunk already was it (a value
stream ends with its result: the same keys are not sent twice).

A request refused before it starts (invalid: 422; overload or no group: 503) gets an ordinary
JSON error response, as on `/v1/step`. A failure after the first line is written travels as a last
line `{"error": {"type", "message"}}` (the status is already 200). A client that disconnects
cancels the request on every rank.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from starlette.responses import StreamingResponse

from phyai_ray.serve.protocols import codec
from phyai_ray.serve.protocols.error_map import HttpError, classify, from_engine_error
from phyai_ray.serve.runtime.options import ServeOptions
from phyai_ray.serve.runtime.runner import GroupRunner

MEDIA_TYPE = "application/x-ndjson"


def add_step_stream_route(api: FastAPI, runner: GroupRunner, options: ServeOptions,
                          decode_and_validate: Callable[[Any, Any, ServeOptions], Any]) -> None:
    """Register `/v1/step/stream`; `decode_and_validate(entry, body, options)` is /v1/step's own check."""

    async def step_stream(http: Request) -> StreamingResponse:
        try:
            raw = json.loads(await http.body())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HttpError(400, f"the body is not JSON: {exc}", type="bad_request") from None
        try:
            request = await asyncio.to_thread(decode_and_validate, runner.entry, raw, options)
            items = runner.stream(request)
            first = await _first(items)
        except Exception as exc:  # refused before anything ran: an ordinary error response
            raise from_engine_error(exc, overload_status=options.overload_status) from None
        return StreamingResponse(_lines(items, first, options.overload_status), media_type=MEDIA_TYPE)

    model = getattr(runner.entry, "request_model", None)  # /v1/step's body (which puts it in the document)
    schema = {"$ref": f"#/components/schemas/{model.__name__}"} if model is not None else {"type": "object"}
    api.add_api_route("/v1/step/stream", step_stream, methods=["POST"], tags=["inference"],
                      summary="Run one request, streamed: one JSON object per line (progress, then the result)",
                      response_class=StreamingResponse, openapi_extra={"requestBody": {
                          "required": True, "content": {"application/json": {"schema": schema}}}})


async def _first(items: AsyncIterator[list]) -> list:
    """The stream's first items: a refusal (nothing ran) raises here, before any header is sent."""
    try:
        first = await items.__anext__()
    except StopAsyncIteration:
        return []
    if first and first[0][0] == "error":  # failed before its first chunk (e.g. a plugin that cannot stream)
        await items.aclose()
        raise first[0][1]
    return first


async def _lines(items: AsyncIterator[list], first: list, overload_status: int) -> AsyncIterator[bytes]:
    """The NDJSON body: each chunk a line, then the result unless the last chunk was it."""
    last: Any = None
    try:
        ready = first
        while True:
            for kind, value in ready:
                if kind == "error":
                    raise value
                if kind == "end":
                    if not _repeats(last, value):
                        yield await asyncio.to_thread(_line, value)
                    return
                last = value
                yield await asyncio.to_thread(_line, value)
            try:
                ready = await items.__anext__()
            except StopAsyncIteration:
                return
    except Exception as exc:  # the status is sent: the error is the last line
        failure = classify(exc, overload_status=overload_status)
        yield (json.dumps({"error": {"type": failure.kind, "message": failure.message}}) + "\n").encode()
    finally:
        await items.aclose()  # a disconnect or an error: the request is cancelled on every rank


def _repeats(last: Any, result: Any) -> bool:
    """Whether the stream's final `result` is its last chunk again (a value stream): dicts of the same keys."""
    return isinstance(last, dict) and isinstance(result, dict) and last.keys() == result.keys()


def _line(value: Any) -> bytes:
    return (json.dumps(codec.encode(value, root="chunk")) + "\n").encode()
