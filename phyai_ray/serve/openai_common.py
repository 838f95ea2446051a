"""What the OpenAI routes share: the error shape, finish reasons, the plugin's request, server-sent events.

    raise OpenAIError(400, "stop holds 5 strings; OpenAI allows at most 4", param="stop")
    openai_error(exc).response()             # any failure in OpenAI's shape, with its failure-table status
    generation_request([[1, 2]], n=2, ...)    # the token plugins' request: every prompt n times
    StreamingResponse(sse(runner, checked, chunks), media_type="text/event-stream")

The bottom of the three OpenAI modules: `openai_text.py` (prompts, stop strings, streamed text),
`openai_chat.py` (/v1/chat/completions) and `openai_api.py` (/v1/completions, /v1/models, and
mounting both) import it, and it imports none of them. A request the plugin refuses is a 400
(`invalid_request_error`, `param` the field when known); every other failure has its row of the
failure table (`serve/error_map.py`).
"""

from __future__ import annotations

import json
import random
from typing import Any, AsyncIterator

from pydantic import ValidationError
from starlette.responses import JSONResponse

from phyai_ray.outputs import entry_values
from phyai_ray.serve.error_map import classify

BAD_REQUEST = 400  # OpenAI's status for a request at fault, the plugin's refusal included
OPENAI_TYPES = {"overloaded": "overloaded_error", "timeout": "timeout_error"}  # every other server kind: server_error


class OpenAIError(Exception):
    """An error as OpenAI's API answers it: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.headers = status, type, param, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


async def sse(runner: Any, request: Any, chunks: Any, interval: int = 1,
              overload_status: int = 503) -> AsyncIterator[str]:
    """Server-sent events of one streamed generation, rendered by `chunks` (`tokens`, `end`, `finished`);
    leaving early (disconnect), or every choice stopping, cancels the generation.

    One write carries every event waiting; after the first token (written at once) a write waits
    until `interval` token steps are there, or the stream ended. `request` is the plugin's, validated."""
    items, final = runner.stream(request), []  # forwarded when this group failed; open as a session meanwhile
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


def finish_reason(out: Any, stopped: bool = False) -> str:
    return "stop" if stopped else {"completed": "stop", "length": "length"}.get(out.stop_reason, "stop")


def generation_request(prompts: list[list[int]], *, n: int, max_tokens: int, temperature: float, top_p: float,
                       seed: int | None, stop_ids: list[int], top_logprobs: int = 0,
                       stop_strings: list[str] | None = None) -> dict[str, Any]:
    """The token plugins' request: every prompt n times (n sequences), one seed for all (each differs by index);
    stop strings go to the plugin (`stop`), which ends a sequence at the token completing one."""
    out = {"prompts": [p for p in prompts for _ in range(n)], "max_tokens": max_tokens, "temperature": temperature,
           "top_p": top_p, "stop_token_ids": list(stop_ids),
           "seed": seed if seed is not None else random.randrange(2 ** 31)}
    if stop_strings:
        out["stop"] = list(stop_strings)
    return {**out, "top_logprobs": top_logprobs} if top_logprobs else out
