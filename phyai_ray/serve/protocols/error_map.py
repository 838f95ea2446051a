"""How failures become HTTP responses: one JSON shape, one status per cause.

    {"error": {"type": "timeout", "message": "replica 1: no result 4.00s after ...", "reason": "request_timeout"}}

4xx means the client's request is at fault and sending it again will not help; 5xx means the
server could not serve it (Retry-After says when trying again makes sense). A server fault is
never reported as 4xx.

| cause                                                        | status     | type                   |
|--------------------------------------------------------------|------------|------------------------|
| missing or wrong bearer key                                  | 401        | unauthorized           |
| body over max_body_bytes (Content-Length or while read)      | 413        | payload_too_large      |
| POST body that is not application/json                      | 415        | unsupported_media_type |
| body that is not JSON                                        | 400        | malformed_json         |
| CodecError, request_model ValidationError                    | 422        | invalid_request        |
| GuardrailError: a safety checker refused its prompt or its   | 400        | guardrail              |
|   output (that request alone; the message never quotes them) |            |                        |
| RequestRejectedError: the plugin's validator refused it      | 422        | rejected      (**)     |
|   (no rank touched)                                          |            |                        |
| OutOfMemoryRequestError: this request did not fit in device  | 503        | out_of_memory (*)      |
|   memory beside the others (it alone failed; retry later)    |            |                        |
| SleepUnsupportedError: sleep() of a plugin that cannot free  | 501        | sleep_unsupported      |
|   anything (a control call; nothing changed)                 |            |                        |
| EngineOverloadedError: every healthy replica's queue is full | 503 or 429 | overloaded    (*)      |
| DeadlineMissedError: its own deadline passed before it       | 504        | deadline_missed        |
|   started; it never ran (the replica keeps serving)          |            |                        |
| RequestTimeoutError: past its own limit (execution_timeout_s | 504        | timeout                |
|   when set, else its estimate; the replica keeps serving)    |            |                        |
| EngineUnavailableError "timeout": its group hung on a request| 504        | timeout                |
| EngineUnavailableError "exception": the plugin raised inside | 500        | execution_error        |
|   a Ray group (the same request would fail again: no retry)  |            |                        |
| any other EngineUnavailableError (no healthy replica, closed)| 503        | unavailable   (*)      |
| the plugin raised while executing (inline/external)          | 500        | execution_error        |
| any other exception in the server (a bug), also in submit    | 500        | internal               |

(*) with `Retry-After: 1`.
(**) on /v1/step; OIP (HTTP and gRPC) and the OpenAI routes answer it 400, their bad-request status
(`classify(exc, rejected_status=400)`), and openpi with an error frame (the session goes on).
503 vs 429 for overload is `ServeOptions.overload_status` (`--overload-status`, `overload_status=`).
`reason` is EngineUnavailableError.reason, "request_timeout" for a RequestTimeoutError,
"deadline_missed", "guardrail" or "out_of_memory".

`classify(exc)` is the one place a failure gets its row; every protocol renders that `Failure` in
its own shape: this JSON API (`HttpError.of`), OpenAI (`openai/common.py` openai_error), OIP over HTTP
(`{"error": ...}`) and gRPC (the status code of the HTTP status, `oip/servicer.py` fail), openpi (an error
frame naming the kind). Only failures pass through here: what a reply that succeeded carries lives
with its protocol (`timing.py` for deadlines and timing, `guard.py` for the key check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from phyai_ray.errors import (DeadlineMissedError, EngineOverloadedError, EngineUnavailableError, GuardrailError,
                              OutOfMemoryRequestError, RequestRejectedError, RequestTimeoutError,
                              SleepUnsupportedError, StreamNotSupportedError)
from phyai_ray.serve.runtime.runner import SubmitFault

_STATUS_TYPES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type",
                 422: "invalid_request", 429: "overloaded", 500: "internal", 503: "unavailable", 504: "timeout"}
RETRY_AFTER = {"Retry-After": "1"}  # seconds; overload and a group restart are usually over by then


@dataclass(frozen=True)
class Failure:
    """A failure as every protocol reports it: its status, kind (the table's type), message and reason."""

    status: int
    kind: str
    message: str
    reason: str | None = None
    retry_after: bool = False
    param: str | None = None  # the request field at fault, when known (OpenAI's `param`)

    @property
    def headers(self) -> dict[str, str] | None:
        return dict(RETRY_AFTER) if self.retry_after else None


def classify(exc: BaseException, *, overload_status: int = 503, rejected_status: int = 422) -> Failure:
    """The table's row for an exception of validating, submitting or running a request (see the module
    docstring); `rejected_status` is the protocol's status for a request its plugin refused."""
    if isinstance(exc, HttpError):  # already classified (a check of the edge itself)
        return Failure(exc.status_code, exc.type, str(exc.detail), exc.reason, "Retry-After" in (exc.headers or {}))
    if isinstance(exc, GuardrailError):
        return Failure(400, "guardrail", str(exc), "guardrail", param=exc.field)
    if isinstance(exc, RequestRejectedError):
        return Failure(rejected_status, "rejected", str(exc), param=exc.field)
    if isinstance(exc, OutOfMemoryRequestError):
        return Failure(503, "out_of_memory", str(exc), "out_of_memory", retry_after=True)
    if isinstance(exc, SleepUnsupportedError):
        return Failure(501, "sleep_unsupported", str(exc))
    if isinstance(exc, StreamNotSupportedError) or isinstance(getattr(exc, "cause", None), StreamNotSupportedError):
        return Failure(400, "bad_request", str(getattr(exc, "cause", None) or exc))
    if isinstance(exc, EngineOverloadedError):
        return Failure(overload_status, "overloaded", f"overloaded, retry later: {exc}", retry_after=True)
    if isinstance(exc, DeadlineMissedError):
        return Failure(504, "deadline_missed", str(exc), "deadline_missed")
    if isinstance(exc, RequestTimeoutError):
        return Failure(504, "timeout", str(exc), "request_timeout")
    if isinstance(exc, EngineUnavailableError):
        if exc.reason == "timeout":  # its group hung on a request
            return Failure(504, "timeout", str(exc), exc.reason)
        if exc.reason == "exception":  # the plugin failed on this request: the same request would fail again
            return Failure(500, "execution_error", str(exc), exc.reason)
        return Failure(503, "unavailable", str(exc), exc.reason, retry_after=True)
    if isinstance(exc, SubmitFault):
        return Failure(500, "internal", f"internal error: {exc}")
    return Failure(500, "execution_error", f"the plugin failed on this request: {describe(exc)}")


class HttpError(HTTPException):
    """An error with its status, type and message; FastAPI re-raises it even from body reading."""

    def __init__(self, status: int, message: str, *, type: str | None = None, reason: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.type = type or _STATUS_TYPES.get(status, "error")
        self.reason = reason

    @classmethod
    def of(cls, failure: Failure) -> "HttpError":
        return cls(failure.status, failure.message, type=failure.kind, reason=failure.reason, headers=failure.headers)


def error_response(error: HttpError) -> JSONResponse:
    """The JSON response of `error`."""
    body: dict[str, Any] = {"type": error.type, "message": str(error.detail)}
    if error.reason is not None:
        body["reason"] = error.reason
    return JSONResponse({"error": body}, status_code=error.status_code, headers=error.headers)


def from_http_exception(exc: HTTPException) -> HttpError:
    """Routing errors (404, 405) and the like, in our shape."""
    if isinstance(exc, HttpError):
        return exc
    return HttpError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


def from_engine_error(exc: BaseException, *, overload_status: int = 503, rejected_status: int = 422) -> HttpError:
    """The response for an exception of validating a request, of `Engine.submit` or of a request's
    future (see the table)."""
    return HttpError.of(classify(exc, overload_status=overload_status, rejected_status=rejected_status))


def from_validation_errors(errors: list[dict[str, Any]]) -> HttpError:
    """FastAPI's body errors: 400 when the body is not JSON at all, else 422 naming each field."""
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        where = detail.get("loc", ("body", "?"))[-1]
        return HttpError(400, f"the body is not valid JSON (at character {where}: "
                         f"{detail.get('ctx', {}).get('error', 'decode error')})", type="malformed_json")
    shown = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors[:10])
    more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
    return HttpError(422, f"the request does not match the schema: {shown}{more}; see /docs", type="invalid_request")


def describe(exc: BaseException) -> str:
    """`Type: message`, one line, for error bodies."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
