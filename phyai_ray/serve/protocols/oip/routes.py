"""Open Inference Protocol v2 (KServe / Triton) over HTTP, on every group's edge.

    GET  /v2                                 server metadata
    GET  /v2/health/live, /v2/health/ready   probes (no key needed, like /healthz and /readyz)
    GET  /v2/models/{name}[/versions/1]      model metadata: the plugin's signature (Entry.inputs/outputs)
    GET  /v2/models/{name}[/versions/1]/ready
    POST /v2/models/{name}[/versions/1]/infer   JSON tensors, or the binary tensor extension

    client = tritonclient.http.InferenceServerClient("127.0.0.1:8000")
    x = tritonclient.http.InferInput("tokens", [1, 4], "INT64"); x.set_data_from_numpy(tokens)
    logits = client.infer("reference_dit", [x], parameters={"guidance_scale": 4.0}).as_numpy("logits")

Each input becomes `request[name]` (a CPU tensor; BYTES a list of bytes); request `parameters`
other than the protocol's reserved ones become plain values of the request. A tensor result is
one output, named by the plugin's first output spec (else `output`); a dict result is one output
per key. The model name is the served model name (`model_name`, default the plugin name); it has
one version, "1". Errors are `{"error": "<what failed, the values, what to do>"}` with the status
of `serve/protocols/error_map.py` (a bad request or one the plugin refuses 400, an unknown model 404,
overload or no group 503).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from phyai_ray import __version__
from phyai_ray.serve.protocols.oip import tensors as oc
from phyai_ray.serve.protocols.error_map import classify, describe
from phyai_ray.serve.protocols.oip.model import (BAD_REQUEST, EXTENSIONS, VERSION, check_signature, finish_request,
                                       model_metadata, missing_outputs, model_name, named_outputs, reply_parameters,
                                       request_deadline, request_late, unknown_model)
from phyai_ray.serve.runtime.options import ServeOptions
from phyai_ray.serve.runtime.runner import GroupRunner
from phyai_ray.validation import Validated

logger = logging.getLogger(__name__)

HEADER_LENGTH = "inference-header-content-length"


def request_id(request: Request) -> str:
    """The request's id: X-Request-ID as Serve's proxy set it (accepted or generated), else a new one."""
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The protocol's error shape."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def add_oip_routes(api: FastAPI, runner: GroupRunner, options: ServeOptions) -> None:
    """Register the /v2 routes; `model_name` (default: the plugin name) is the protocol's model name."""
    model = model_name(options, runner.entry)

    def known(name: str, version: str | None) -> None:
        problem = unknown_model(name, version, model)
        if problem is not None:
            raise oc.OipError(problem, 404)

    async def server_metadata() -> dict[str, Any]:
        return {"name": "phyai-ray", "version": __version__, "extensions": EXTENSIONS}

    async def live() -> dict[str, bool]:
        return {"live": True}

    async def ready() -> Response:
        return JSONResponse({"ready": True}) if runner.ready else error(503, "not ready: no replica group can serve")

    async def metadata(name: str, version: str | None = None) -> Response:
        known(name, version)
        return JSONResponse(model_metadata(runner.entry, model))

    async def model_ready(name: str, version: str | None = None) -> Response:
        known(name, version)
        return await ready()

    async def infer(request: Request, name: str, version: str | None = None) -> Response:
        known(name, version)
        rid = request_id(request)
        try:  # validated once, in parse_infer; the request is never cancelled
            body = await request.body()
            parsed = await asyncio.to_thread(parse_infer, body, request.headers.get(HEADER_LENGTH), runner.entry,
                                             options)
            result = await runner.run(parsed.request, deadline_s=parsed.deadline_s, timing=parsed.timing,
                                      late=parsed.late)
        except (oc.OipError, HTTPException) as exc:
            status = getattr(exc, "status", None) or getattr(exc, "status_code", 500)
            logger.info("infer %s on group %s: %s %s", rid, runner.group, status, getattr(exc, "detail", exc))
            raise
        except Exception as exc:  # the plugin's refusal (400), an engine error: its row of the failure table
            failure = classify(exc, overload_status=options.overload_status, rejected_status=BAD_REQUEST)
            logger.info("infer %s on group %s: %s %s", rid, runner.group, failure.status, failure.message)
            return error(failure.status, failure.message, failure.headers)
        return await asyncio.to_thread(respond, parsed, result, model, rid, runner)

    for path, handler in (("/v2", server_metadata), ("/v2/health/live", live), ("/v2/health/ready", ready),
                          ("/v2/models/{name}", metadata), ("/v2/models/{name}/versions/{version}", metadata),
                          ("/v2/models/{name}/ready", model_ready),
                          ("/v2/models/{name}/versions/{version}/ready", model_ready)):
        api.add_api_route(path, _guarded(handler), methods=["GET"], tags=["open inference protocol"])
    for path in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"):
        api.add_api_route(path, _guarded(infer), methods=["POST"], tags=["open inference protocol"],
                          summary="Run one request (JSON tensors or the binary tensor extension)")


def _guarded(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`handler` with every failure answered in the protocol's error shape."""
    @functools.wraps(handler)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(*args, **kwargs)
        except oc.OipError as exc:
            return error(exc.status, str(exc))
        except HTTPException as exc:  # the body limit, an engine error
            return error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))
        except Exception as exc:
            logger.exception("open inference protocol route failed")
            return error(500, f"internal error: {describe(exc)}")

    return wrapped


class Parsed:
    """A checked infer request: the plugin's request (validated), the outputs asked for and how to send them."""

    def __init__(self, request: Validated, id: str | None, outputs: dict[str, bool] | None,
                 binary: bool, deadline_s: float | None = None, late: str | None = None) -> None:
        self.request, self.id, self.outputs, self.binary = request, id, outputs, binary
        self.deadline_s, self.late = deadline_s, late
        self.received_at = time.time()  # parsed as it arrives: the reply's received_at (Unix seconds)
        self.timing: dict[str, Any] = {}


def parse_infer(body: bytes, header_length: str | None, entry: Any, options: ServeOptions) -> Parsed:
    """Header JSON and binary inputs -> the plugin's request, checked against the signature and validator."""
    header, rest = _split(body, header_length)
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise oc.OipError("'inputs' must be a non-empty list of {name, datatype, shape, data}")
    if len(inputs) > options.max_tensors:
        raise oc.OipError(f"{len(inputs)} inputs are more than the limit of {options.max_tensors}")
    request = _inputs(inputs, rest, options.max_tensor_bytes, entry)
    params = header.get("parameters") or {}
    if not isinstance(params, dict):
        raise oc.OipError(f"'parameters' must be an object, got {type(params).__name__}")
    deadline_s, late = request_deadline(params), request_late(params)
    return Parsed(finish_request(request, params, entry), header.get("id"), _requested(header.get("outputs")),
                  bool(params.get("binary_data_output", False)), deadline_s, late)


def _split(body: bytes, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    view = memoryview(body)
    if header_length is None:
        size = len(body)
    else:
        try:
            size = int(header_length)
        except ValueError:
            raise oc.OipError(f"Inference-Header-Content-Length {header_length!r} is not an integer") from None
        if not 0 < size <= len(body):
            raise oc.OipError(f"Inference-Header-Content-Length is {size}, but the body holds {len(body)} bytes")
    try:
        header = json.loads(bytes(view[:size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise oc.OipError(f"the inference header is not valid JSON: {exc}") from None
    except RecursionError:  # the decoder's own depth limit: a hostile body, never a server fault
        raise oc.OipError("the inference header is nested too deeply to decode; flatten the tensors' "
                          f"'data' (at most {oc.MAX_DEPTH} levels are read)") from None
    if not isinstance(header, dict):
        raise oc.OipError(f"the inference header must be a JSON object, got {type(header).__name__}")
    return header, view[size:]


def _inputs(inputs: list[Any], rest: memoryview, max_bytes: int, entry: Any) -> dict[str, Any]:
    headers = [oc.check_header(item, f"inputs[{i}]") for i, item in enumerate(inputs)]
    names = [h[0] for h in headers]
    if len(set(names)) != len(names):
        raise oc.OipError(f"input names must be unique, got {names}")
    check_signature(entry, {name: (datatype, shape) for name, datatype, shape, _ in headers})
    sizes = [h[3].get("binary_data_size") for h in headers]
    declared = sum(s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s >= 0)
    if any(s is not None and not (isinstance(s, int) and s >= 0) for s in sizes):
        raise oc.OipError(f"binary_data_size must be an int >= 0, got {sizes}")
    if declared != len(rest):
        raise oc.OipError(f"the inputs declare {declared} bytes of binary data (binary_data_size), but the body "
                          f"holds {len(rest)} after the header; the body is truncated or the sizes are wrong")
    if declared > max_bytes:
        raise oc.OipError(f"{declared} bytes of binary inputs are over the limit of {max_bytes}", 413)
    out, at = {}, 0
    for (name, datatype, shape, _), item, size in zip(headers, inputs, sizes):
        if size is None:
            if "data" not in item:
                raise oc.OipError(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
            out[name] = oc.from_json(name, datatype, shape, item["data"], max_bytes)
        else:
            out[name] = oc.from_bytes(name, datatype, shape, rest[at:at + size])
            at += size
    return out


def _requested(outputs: Any) -> dict[str, bool] | None:
    """name -> binary? of each output asked for; None: all outputs."""
    if outputs is None:
        return None
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):
        raise oc.OipError("'outputs' must be a list of {name, parameters: {binary_data}}")
    return {o["name"]: bool((o.get("parameters") or {}).get("binary_data", False)) for o in outputs}


def respond(parsed: Parsed, result: Any, model: str, rid: str, runner: GroupRunner) -> Response:
    """The infer response: JSON, or the JSON header followed by the binary outputs."""
    values = named_outputs(result, runner.entry)
    wanted = parsed.outputs if parsed.outputs is not None else {n: parsed.binary for n in values}
    missing_outputs(wanted, values)
    outputs, chunks = [], []
    for name, binary in wanted.items():
        out, raw = oc.to_output(name, values[name], binary)
        outputs.append(out)
        if raw is not None:
            chunks.append(raw)
    body = {"model_name": model, "model_version": VERSION, "id": parsed.id or rid, "outputs": outputs}
    params = reply_parameters(parsed.timing, parsed.deadline_s, parsed.received_at)
    if params:
        body["parameters"] = params
    header = json.dumps(body).encode()
    if not chunks:
        return Response(header, media_type="application/json")
    return Response(b"".join([header, *chunks]), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(header))})

