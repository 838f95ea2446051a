"""The FastAPI application each replica group serves: routes, error handlers, the edge guard and metrics.

    POST /v1/step       one request -> one result (JSON; tensors in the codec's encoding)
    POST /v1/step/stream  the same, streamed: one JSON object per line (step_stream.py)
    GET  /healthz       liveness: the group's Serve replica answers (no key needed)
    GET  /readyz        200 when >= 1 replica group can serve, else 503 (no key needed, so no details)
    GET  /v1/replicas   state, in-flight, served, failures, failure cause, nodes and pids of every group
    GET  /metrics       Prometheus text
    POST /v1/completions, GET /v1/models   OpenAI-compatible, for token plugins (openai/api.py)
    /v1/videos          OpenAI's Videos API, for world models: jobs, progress, MP4 (openai/videos.py)
    /v2/...             Open Inference Protocol v2 (KServe / Triton), JSON and binary tensors (oip/routes.py)
    WS   /v1/openpi     openpi's robot-policy WebSocket (openpi.py)
    GET  /docs, /openapi.json

The body of `/v1/step` is the plugin's `request_model` when it declares one (validated and
documented), else any JSON object. Nothing from the network is ever unpickled. Decoding and
encoding tensors run on a worker thread, never on the event loop that answers health checks.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

from fastapi import Body, FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phyai_ray import __version__
from phyai_ray.serve.protocols import codec
from phyai_ray.serve.protocols.error_map import (RETRY_AFTER, HttpError, describe, error_response, from_engine_error,
                                       from_http_exception, from_validation_errors)
from phyai_ray.serve.protocols.guard import OIP_PREFIX, OPEN_PATHS, EdgeGuard
from phyai_ray.serve.runtime.metrics import EdgeMetrics
from phyai_ray.serve.runtime.options import ServeOptions
from phyai_ray.serve.runtime.runner import GroupRunner
from phyai_ray.serve.protocols.schema import ErrorBody, StepResponse
from phyai_ray.serve.protocols.step_stream import add_step_stream_route
from phyai_ray.serve.protocols.timing import DEADLINE_HEADER, deadline_ms
from phyai_ray.validation import Validated, validate

ROUTES = ("/v1/step", "/v1/step/stream", "/v1/completions", "/v1/models", "/v1/videos", "/v1/replicas", "/healthz", "/readyz", "/metrics", "/docs", "/openapi.json")
ERRORS = {status: {"model": ErrorBody, "description": text} for status, text in (
    (400, "the body is not JSON"), (401, "missing or wrong API key"),
    (404, "the path names a model or version this server does not serve"), (413, "body over the size limit"),
    (415, "not application/json"), (422, "schema, codec or plugin validation failed; no rank was touched"),
    (429, "overloaded, when the server runs with overload_status=429; retry after Retry-After"),
    (500, "the plugin failed on this request, or a server fault"),
    (503, "overloaded, or no replica group can serve; retry after Retry-After"),
    (504, "the request passed execution_timeout_s"))}


def create_api(runner: GroupRunner, options: ServeOptions) -> FastAPI:
    """The ASGI app of one replica group; every group of the app serves the same one."""
    api = FastAPI(title=f"phyai-ray: {runner.entry.display_name()}", version=__version__,
                  description=__doc__.split("\n\n")[1] + _auth_note(options))
    metrics = EdgeMetrics(runner.groups, own=lambda: [runner.report()], batches=lambda: runner.engine.batch_stats())
    runner.on_timing = metrics.observe_timing
    _add_error_handlers(api)
    _add_probe_routes(api, runner, metrics)
    _add_step_route(api, runner, options)
    add_step_stream_route(api, runner, options, _decode_and_validate)
    if getattr(runner.entry, "generates_tokens", False):
        from phyai_ray.serve.protocols.openai.api import add_openai_routes

        add_openai_routes(api, runner, options)
    if getattr(runner.entry, "generates_video", False):
        from phyai_ray.serve.protocols.openai.videos import add_video_routes

        add_video_routes(api, runner, options)
    _add_protocol_routes(api, runner, options)
    declare_errors(api)
    api.add_middleware(EdgeGuard, keys=options.key_table(), max_body_bytes=options.max_body_bytes)
    api.add_middleware(_Measured, metrics=metrics)  # outermost: counts what the guard rejects too
    api.state.metrics = metrics
    return api


_BODY_ERRORS = (400, 413, 415, 422, 429, 503, 504)  # what a route that reads a body and runs a request may answer
_OWN_SHAPE = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/videos", OIP_PREFIX)  # their protocol's error body


def declare_errors(api: FastAPI) -> None:
    """Every route's OpenAPI entry lists the errors it can answer, so a client generated from the document
    knows them: 401 (the key guard; not the open probes), 500 everywhere, and the body and engine errors
    on routes that take a body. The phyai-ray routes' errors have `ErrorBody`'s shape; the OpenAI and
    OIP routes answer in their protocol's own error shape (described, not modelled here)."""
    routes = [route for route in api.routes if isinstance(route, APIRoute)]
    # ErrorBody's field as FastAPI built it for /v1/step (which declares every error at creation): a route
    # given the model afterwards needs the field too, or its document shows the status without the body
    fields = next(route.response_fields for route in routes if route.path == "/v1/step")
    for route in routes:
        own = route.path.startswith(_OWN_SHAPE)
        codes = ([] if route.path in OPEN_PATHS else [401]) + [500] + ([404] if "{" in route.path else [])
        if route.methods & {"POST", "PUT"}:
            codes += list(_BODY_ERRORS)
        for code in codes:
            if code in route.responses:
                continue
            route.responses[code] = {"description": ERRORS[code]["description"]} if own else dict(ERRORS[code])
            if not own and code in fields:
                route.response_fields[code] = fields[code]


def _add_protocol_routes(api: FastAPI, runner: GroupRunner, options: ServeOptions) -> None:
    """The protocols existing clients speak, each behind its switch (ServeOptions.oip_http, .openpi)."""
    if options.oip_http:
        from phyai_ray.serve.protocols.oip.routes import add_oip_routes

        add_oip_routes(api, runner, options)
    if options.openpi:
        from phyai_ray.serve.protocols.openpi import add_openpi_route

        add_openpi_route(api, runner, options)


def _auth_note(options: ServeOptions) -> str:
    if options.key_table() is None:
        return ""
    return " Every route but /healthz and /readyz needs the header `Authorization: Bearer <key>`."


def _add_error_handlers(api: FastAPI) -> None:
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(from_http_exception(exc))

    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_errors(list(exc.errors())))

    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(HttpError(500, f"internal error: {describe(exc)}"))

    api.add_exception_handler(HTTPException, http_error)
    api.add_exception_handler(RequestValidationError, validation_error)
    api.add_exception_handler(Exception, internal_error)


def _add_probe_routes(api: FastAPI, runner: GroupRunner, metrics: EdgeMetrics) -> None:
    @api.get("/healthz", tags=["health"], summary="Liveness: this group's Serve replica answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/readyz", tags=["health"], summary="Readiness: at least one replica group can serve",
             responses={503: ERRORS[503]})
    async def readyz() -> dict[str, Any]:
        """Open to anyone, so it says ready or not and nothing more; /v1/replicas (keyed) has the causes."""
        if not runner.ready:
            raise HttpError(503, "not ready: no replica group can serve now; GET /v1/replicas for the causes",
                            type="unavailable", headers=dict(RETRY_AFTER))
        return {"ready": True}

    @api.get("/v1/replicas", tags=["status"], summary="State, load and failure cause of every replica group")
    async def replicas() -> dict[str, Any]:
        groups = runner.groups(metrics.request_counts())
        rows = [{"index": i, **g.to_dict()} for i, g in enumerate(groups)]
        return {"mode": runner.engine.mode, "healthy": any(g.healthy for g in groups), "group": runner.group,
                "rebuilding": runner.holder.rebuilding, "rebuilds": sum(g.rebuilds for g in groups),
                "replicas": rows}

    @api.get("/metrics", tags=["status"], summary="Prometheus metrics (text format)",
             response_class=Response)
    async def prometheus() -> Response:
        text, content_type = metrics.exposition()
        return Response(text, media_type=content_type)


def _add_step_route(api: FastAPI, runner: GroupRunner, options: ServeOptions) -> None:
    async def step(http: Request, body: Any) -> JSONResponse:
        deadline_s = header_deadline(http)
        raw = body.model_dump(mode="json", by_alias=True) if isinstance(body, BaseModel) else body
        timing: dict[str, Any] = {}
        try:  # validated once, here; the request is never cancelled
            request = await asyncio.to_thread(_decode_and_validate, runner.entry, raw, options)
            result = await runner.run(request, deadline_s=deadline_s, timing=timing)
        except Exception as exc:  # a rejection (422), an engine error: its row of the failure table
            raise from_engine_error(exc, overload_status=options.overload_status) from None
        return JSONResponse({"result": await asyncio.to_thread(_encode, result)}, headers=server_timing(timing))

    model = runner.entry.request_model
    annotation = model if model is not None else Any
    docs = "The plugin's request" + ("" if model is not None else " (any JSON object)") + \
        "; tensors as {\"__tensor__\": {\"dtype\", \"shape\", \"data\"}}."
    step.__signature__ = inspect.Signature(  # the plugin's model becomes the typed, documented body
        [inspect.Parameter("http", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
         inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation,
                           default=Body(..., description=docs))])
    step.__annotations__ = {"http": Request, "body": annotation, "return": JSONResponse}
    api.add_api_route("/v1/step", step, methods=["POST"], tags=["inference"], summary="Run one request",
                      responses={200: {"model": StepResponse}, **{k: v for k, v in ERRORS.items() if k != 404}},
                      response_class=JSONResponse)


def header_deadline(http: Request) -> float | None:
    """`X-Request-Deadline-Ms` in seconds (None without it); a bad value is a 400 saying why."""
    try:
        return deadline_ms(http.headers.get(DEADLINE_HEADER), "X-Request-Deadline-Ms")
    except ValueError as exc:
        raise HttpError(400, str(exc), type="bad_request") from None


def server_timing(timing: dict[str, Any]) -> dict[str, str] | None:
    """The W3C `Server-Timing` header of a request's timing (queue and infer, milliseconds)."""
    if not timing:
        return None
    parts = [f"{name};dur={timing[key]}" for name, key in (("queue", "queue_ms"), ("infer", "infer_ms"))
             if timing.get(key) is not None]
    parts.append(f"batch;desc={timing.get('batch_size', 0)}")
    if timing.get("deadline_met") is not None:
        parts.append(f"deadline;desc={'met' if timing['deadline_met'] else 'missed'}")
    return {"Server-Timing": ", ".join(parts)}


def _decode_and_validate(entry: Any, raw: Any, options: ServeOptions) -> Validated:
    """Tensors from the body (422 on a codec error), then the plugin's validator, once
    (`RequestRejectedError`: 422 "rejected").

    Only these two make a 4xx: whatever else fails later is the server's fault and must not look
    like a bad request.
    """
    try:
        request = codec.decode(raw, root="request", max_tensors=options.max_tensors,
                               max_total_bytes=options.max_tensor_bytes)
    except codec.CodecError as exc:
        raise HttpError(422, str(exc), type="invalid_request") from None
    return validate(entry, request)


def _encode(result: Any) -> Any:
    try:
        return codec.encode(result, root="result")
    except codec.CodecError as exc:
        raise HttpError(500, f"the plugin's result cannot be sent as JSON: {exc}", type="internal") from None


class _Measured:
    """Outermost ASGI layer: request count by route and status, latency, in-flight."""

    def __init__(self, app: ASGIApp, *, metrics: EdgeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else "/v2" if path.startswith("/v2/") or path == "/v2" else "other"
        status, start = 500, time.perf_counter()

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.add_in_flight(1)
        try:
            await self.app(scope, receive, record)
        finally:
            self.metrics.add_in_flight(-1)
            self.metrics.observe(route, status, time.perf_counter() - start)
