"""`EdgeGuard`: the checks every HTTP request passes before any route sees it.

In order: the bearer key (all paths but the health probes; the tenant whose key it is goes into the
request's state, `request.state.tenant`, for the routes that scope what they list per caller), then for requests with a body the
size limit (the declared Content-Length first; a chunked or lying body is counted while it is
read) and the content type (JSON only; `FORM_PATHS` take a multipart form too, as OpenAI's
clients send it there). A pure ASGI middleware, so the limit holds no matter
how a route reads the body. Open Inference Protocol paths (`/v2...`) carry JSON or the binary
tensor extension, so their content type is the route's to judge, and their errors take that
protocol's shape, `{"error": "..."}`.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phyai_ray.serve.protocols.error_map import HttpError, error_response

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})
OIP_PREFIX = "/v2"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
FORM_PATHS = frozenset({"/v1/videos"})  # OpenAI's create call: its clients send multipart/form-data


def key_matches(authorization: str | None, key: str | dict[str, str] | None,
                schemes: tuple[str, ...] = ("bearer",)) -> bool:
    """Whether an Authorization value (`<scheme> <key>`) carries `key` (or any key of a {key: tenant} table)
    under one of `schemes`; True without a key.

    The one API-key check of every protocol: this guard (HTTP), OIP's gRPC methods, openpi's WebSocket."""
    if key is None:
        return True
    return tenant_of(authorization, key if isinstance(key, dict) else {key: "default"}, schemes) is not None


def tenant_of(authorization: str | None, keys: dict[str, str], schemes: tuple[str, ...] = ("bearer",)) -> str | None:
    """The tenant whose key the Authorization value carries ({key: tenant}); None when it carries none of them.
    Every key is compared, each in constant time, so how long it takes says nothing about which one is close."""
    scheme, _, token = str(authorization or "").partition(" ")
    given, found = token.strip().encode("latin-1", "replace"), None
    for key, tenant in keys.items():
        if hmac.compare_digest(given, key.encode("utf-8")) and found is None:
            found = tenant
    return found if scheme.lower() in schemes else None


class EdgeGuard:
    """Bearer key, body limit and content type, answered with the JSON error shape."""

    def __init__(self, app: ASGIApp, *, keys: dict[str, str] | None, max_body_bytes: int) -> None:
        self.app, self.keys, self.max_body_bytes = app, keys, max_body_bytes  # keys: {key: tenant}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check(scope)
        except HttpError as error:
            if _is_oip(_route_path(scope)):
                response = JSONResponse({"error": str(error.detail)}, error.status_code, headers=error.headers)
            else:
                response = error_response(error)
            await response(scope, receive, send)
            return
        await self.app(scope, _limited(receive, self.max_body_bytes), send)

    def _check(self, scope: Scope) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if _route_path(scope) not in OPEN_PATHS:
            scope.setdefault("state", {})["tenant"] = self._check_key(headers.get("authorization", ""))
        if scope.get("method") in BODY_METHODS and _method_routed(scope):
            _check_length(headers.get("content-length"), self.max_body_bytes)
            path = _route_path(scope)
            if not _is_oip(path):
                _check_json(headers.get("content-type"), form=path in FORM_PATHS)

    def _check_key(self, authorization: str) -> str | None:
        """The caller's tenant (None on a server without keys), else a 401."""
        if self.keys is None:
            return None
        tenant = tenant_of(authorization, self.keys)
        if tenant is not None:
            return tenant
        raise HttpError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                            headers={"WWW-Authenticate": "Bearer"})


def _method_routed(scope: Scope) -> bool:
    """False when a route has this path but not this method (PUT on a POST route): the body checks are
    skipped, so the router answers 405 naming the allowed methods, not 415 for a body it would never read."""
    routes = getattr(getattr(scope.get("app"), "router", None), "routes", ())
    partial = False
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return True
        partial = partial or match is Match.PARTIAL
    return not partial


def _route_path(scope: Scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _is_oip(path: str) -> bool:
    return path == OIP_PREFIX or path.startswith(OIP_PREFIX + "/")


def _check_length(declared: str | None, limit: int) -> None:
    if declared is None:
        return
    try:
        size = int(declared)
    except ValueError:
        raise HttpError(400, f"Content-Length {declared!r} is not an integer") from None
    if size > limit:
        raise HttpError(413, f"the body is {size} bytes, over the limit of {limit} bytes; send less "
                        "(or start the server with a larger --max-body-bytes)")


def _check_json(content_type: str | None, form: bool = False) -> None:
    media = (content_type or "").split(";")[0].strip().lower()
    if form and media == "multipart/form-data":
        return
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise HttpError(415, f"Content-Type {content_type!r} is not supported; send JSON with "
                        "'Content-Type: application/json'")


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive` that raises 413 once more than `limit` body bytes have arrived."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HttpError(413, f"the body passed the limit of {limit} bytes while being read; send less "
                                "(or start the server with a larger --max-body-bytes)")
        return message

    return wrapped

