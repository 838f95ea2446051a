"""What the OpenAI routes share: the error shape, finish reasons, the plugin's request, server-sent events.

    raise OpenAIError(400, "stop holds 5 strings; OpenAI allows at most 4", param="stop")
    openai_error(exc).response()             # any failure in OpenAI's shape, with its failure-table status
    generation_request([[1, 2]], n=2, ...)    # the token plugins' request: every prompt n times
    StreamingResponse(sse(runner, checked, chunks), media_type="text/event-stream")
    deadline = RequestDeadline(http.headers.get("x-request-deadline-ms"), body.get("deadline_ms"))

The bottom of the three OpenAI modules: `text.py` (prompts, stop strings, streamed text),
`chat.py` (/v1/chat/completions) and `api.py` (/v1/completions, /v1/models, and
mounting both) import it, and it imports none of them. A request the plugin refuses is a 400
(`invalid_request_error`, `param` the field when known); every other failure has its row of the
failure table (`serve/protocols/error_map.py`).

Deadlines (both routes, streamed or not): the `X-Request-Deadline-Ms` header, or `deadline_ms` in
the body (an extension of OpenAI's API: `extra_body={"deadline_ms": 150}` in the openai client),
in milliseconds from the request's arrival; the earlier one when both are given. A whole request
must meet it (finish-by: max_tokens x the loop's recent iteration time must fit), else it is a 504
`deadline_missed` at once. A stream must deliver its first chunk by it; one that cannot is answered
with an SSE error event (code 504) and `data: [DONE]`, not a 504 status: the response's 200 and
headers go out when the route returns, before the stream opens, and a proxy or client then sees the
stream start at once instead of waiting with no byte; the openai client raises `APIError` from it.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any, AsyncIterator, ClassVar

from pydantic import BaseModel, Field, ValidationError
from starlette.responses import JSONResponse

from phyai_ray.outputs import entry_values
from phyai_ray.plugins.tokens import GenerationRequest, TokenResult
from phyai_ray.serve.protocols.error_map import classify
from phyai_ray.serve.protocols.timing import deadline_ms

BAD_REQUEST = 400  # OpenAI's status for a request at fault, the plugin's refusal included
OPENAI_TYPES = {"overloaded": "overloaded_error", "timeout": "timeout_error",  # every other server kind: server_error
                "deadline_missed": "deadline_missed"}  # as every other protocol names it (error_map.py)


class OpenAIError(Exception):
    """An error as OpenAI's API answers it: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.headers = status, type, param, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class RequestDeadline:
    """A request's own deadline from `X-Request-Deadline-Ms` (`header`) and the body's `deadline_ms`
    (see the module docstring), held from its arrival: `left()` is the seconds that remain (None:
    no deadline; a spent one leaves a microsecond, which the engine answers as missed). A bad value
    is a 400 naming the header or the field."""

    def __init__(self, header: Any, body: Any) -> None:
        self.received = time.monotonic()
        given = []
        for value, where in ((header, "X-Request-Deadline-Ms"), (body, "deadline_ms")):
            try:
                seconds = deadline_ms(value, where)
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param=where) from None
            if seconds is not None:
                given.append(seconds)
        self.seconds = min(given, default=None)

    def left(self) -> float | None:
        if self.seconds is None:
            return None
        return max(self.seconds - (time.monotonic() - self.received), 1e-6)


async def sse(runner: Any, request: Any, chunks: Any, interval: int = 1, overload_status: int = 503,
              deadline: RequestDeadline | None = None) -> AsyncIterator[str]:
    """Server-sent events of one streamed generation, rendered by `chunks` (`tokens`, `end`, `finished`);
    leaving early (disconnect), or every choice stopping, cancels the generation.

    One write carries every event waiting; after the first token (written at once) a write waits
    until `interval` token steps are there, or the stream ended. `request` is the plugin's, validated.
    `deadline`: the first chunk's (see the module docstring)."""
    left = deadline.left() if deadline is not None else None
    items = runner.stream(request) if left is None else runner.stream(request, deadline_s=left)
    final: list = []  # forwarded when this group failed; open as a session meanwhile
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


def openai_error(exc: Exception, *, overload_status: int = 503) -> OpenAIError:
    """`exc` in OpenAI's error shape: a bad body is 400, anything else has its row of the failure table."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return OpenAIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                           param=str(first["loc"][0]) if first["loc"] else None)
    failure = classify(exc, overload_status=overload_status, rejected_status=BAD_REQUEST)
    kind = OPENAI_TYPES.get(failure.kind, "server_error" if failure.status >= 500 else "invalid_request_error")
    return OpenAIError(failure.status, failure.message, type=kind, param=failure.param, headers=failure.headers)


def finish_reason(out: TokenResult, stopped: bool = False) -> str:
    return "stop" if stopped else {"completed": "stop", "length": "length"}.get(out.stop_reason, "stop")


class ProcessorFields(BaseModel):
    """The sampling fields both routes share beyond temperature / top_p, as vLLM defines them: logit
    bias ({"14": 100}: token id as a string, -100..100), presence / frequency penalties (-2..2, the
    output so far), repetition penalty (> 0, prompt and output), min_p. Those that are not
    implemented (`UNSUPPORTED`) are a 400 naming the field, never ignored."""

    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    prompt_logprobs: Any = None  # vLLM's extension; not implemented: refused

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)

    def unsupported_sampling(self) -> str | None:
        """The first sampling field given that this server does not implement (None: all honoured)."""
        return next((f for f in self.UNSUPPORTED if getattr(self, f) not in (None, 0, False)), None)

    def processors(self) -> dict[str, Any]:
        """`generation_request`'s processor arguments; a logit_bias key that is no token id is a 400."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not str(key).lstrip("-").isdigit() or not -100.0 <= value <= 100.0:
                raise OpenAIError(BAD_REQUEST, f"logit_bias maps token ids (as strings) to values in [-100, 100]; "
                                               f"got {key!r}: {value!r}", param="logit_bias")
            bias.append((int(key), float(value)))
        return {"logit_bias": tuple(bias), "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "min_p": self.min_p}


def generation_request(prompts: list[list[int]], *, n: int, max_tokens: int, temperature: float, top_p: float,
                       seed: int | None, stop_ids: list[int], top_logprobs: int = 0,
                       stop_strings: list[str] | None = None, **processors: Any) -> dict[str, Any]:
    """The token plugins' request (`phyai_ray.plugins.tokens.GenerationRequest`) as it travels: every
    prompt n times (n sequences), one seed for all (each differs by index; a fresh one when not given);
    `processors`: `ProcessorFields.processors()`."""
    return GenerationRequest(
        prompts=tuple(map(tuple, prompts)), n=n, max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, seed=seed if seed is not None else random.randrange(2 ** 31), stop_token_ids=tuple(stop_ids),
        stop=tuple(stop_strings or ()), top_logprobs=top_logprobs, **processors).as_dict()
