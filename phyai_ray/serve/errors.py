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
| the plugin's validate_request raised (no rank touched)       | 422        | rejected               |
| EngineOverloadedError: every healthy replica's queue is full | 503 or 429 | overloaded    (*)      |
| RequestTimeoutError: no result execution_timeout_s after it  | 504        | timeout                |
|   was submitted (the replica keeps serving)                  |            |                        |
| EngineUnavailableError "timeout": its group hung on a request| 504        | timeout                |
| EngineUnavailableError "exception": the plugin raised inside | 500        | execution_error        |
|   a Ray group (the same request would fail again: no retry)  |            |                        |
| any other EngineUnavailableError (no healthy replica, closed)| 503        | unavailable   (*)      |
| the plugin raised while executing (inline/external)          | 500        | execution_error        |
| any other exception in the server (a bug), also in submit    | 500        | internal               |

(*) with `Retry-After: 1`.
503 vs 429 for overload is `ServeOptions.overload_status` (`--overload-status`, `overload_status=`).
`reason` is EngineUnavailableError.reason, or "request_timeout" for a RequestTimeoutError.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from phyai_ray.errors import EngineOverloadedError, EngineUnavailableError, RequestTimeoutError

_STATUS_TYPES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type",
                 422: "invalid_request", 429: "overloaded", 500: "internal", 503: "unavailable", 504: "timeout"}
RETRY_AFTER = {"Retry-After": "1"}  # seconds; overload and a group restart are usually over by then
ENGINE_ERRORS = (EngineOverloadedError, RequestTimeoutError, EngineUnavailableError)


class HttpError(HTTPException):
    """An error with its status, type and message; FastAPI re-raises it even from body reading."""

    def __init__(self, status: int, message: str, *, type: str | None = None, reason: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.type = type or _STATUS_TYPES.get(status, "error")
        self.reason = reason


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


def from_engine_error(exc: BaseException, *, overload_status: int = 503) -> HttpError:
    """The response for an exception of `Engine.submit` or of a request's future (see the table)."""
    if isinstance(exc, EngineOverloadedError):
        return HttpError(overload_status, f"overloaded, retry later: {exc}", type="overloaded",
                         headers=dict(RETRY_AFTER))
    if isinstance(exc, RequestTimeoutError):
        return HttpError(504, str(exc), type="timeout", reason="request_timeout")
    if isinstance(exc, EngineUnavailableError):
        return from_unavailable(exc)
    return HttpError(500, f"internal error: {describe(exc)}", type="internal")


def from_unavailable(exc: EngineUnavailableError) -> HttpError:
    """504 when its group hung on a request, 500 when the plugin raised in a Ray group, else 503."""
    if exc.reason == "timeout":
        return HttpError(504, str(exc), type="timeout", reason=exc.reason)
    if exc.reason == "exception":  # the plugin failed on this request: the same request would fail again
        return HttpError(500, str(exc), type="execution_error", reason=exc.reason)
    return HttpError(503, str(exc), type="unavailable", reason=exc.reason, headers=dict(RETRY_AFTER))


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
