"""Open Inference Protocol v2 over gRPC (`inference.GRPCInferenceService`), through Ray Serve's gRPC proxy.

    phyai-ray serve reference_dit --dense-tp-size 2 --replicas 2 --device cpu --grpc-port 9000
    client = tritonclient.grpc.InferenceServerClient("127.0.0.1:9000")
    client.infer("reference_dit", [x], headers={"authorization": "Bearer KEY"}).as_numpy("logits")

Serve's gRPC proxy serves any service whose `add_..._to_server` function it is given
(`grpc_options.grpc_servicer_functions`, SERVICER_FUNCTION here) and calls the ingress
deployment's method of the RPC's name with the request message; with one application it needs
no `application` metadata, so `tritonclient.grpc` calls it as it is. Each RPC then runs on one
group picked by the group router, like an HTTP request. `OipGrpcMethods` is that set of methods,
mixed into `ReplicaGroup`. The messages come from `grpc_v2/grpc_predict_v2.proto` (generated
modules beside it; `make grpc-stubs` regenerates them).

Inputs arrive in `raw_input_contents` (what tritonclient sends) or in typed `contents`; outputs
always go back in `raw_output_contents`. Errors are gRPC status codes with the message as details:
INVALID_ARGUMENT (bad request), NOT_FOUND (unknown model), UNAUTHENTICATED (key), UNAVAILABLE
(overload, no group), DEADLINE_EXCEEDED, INTERNAL.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from phyai_ray import __version__
from phyai_ray.serve.protocols.oip import tensors as oc
from phyai_ray.serve.protocols.error_map import classify
from phyai_ray.serve.protocols.guard import key_matches
from phyai_ray.serve.protocols.oip.model import (BAD_REQUEST, EXTENSIONS, VERSION, check_signature, finish_request,
                                       missing_outputs, model_name, model_metadata, named_outputs, reply_parameters,
                                       request_deadline, request_late, unknown_model)
from phyai_ray.validation import Validated

SERVICER_FUNCTION = "phyai_ray.serve.grpc_v2.grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server"
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents", "BYTES": "bytes_contents"}
_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED",
          429: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def pb() -> Any:
    from phyai_ray.serve.grpc_v2 import grpc_predict_v2_pb2

    return grpc_predict_v2_pb2


def fail(context: Any, status: int, message: str) -> None:
    """Set the gRPC status matching an HTTP status on the call."""
    import grpc

    if context is not None:
        context.set_code(getattr(grpc.StatusCode, _CODES.get(status, "INTERNAL")))
        context.set_details(message)


def parameter(value: Any) -> Any:
    """An InferParameter's value as a plain Python value."""
    choice = value.WhichOneof("parameter_choice")
    return None if choice is None else getattr(value, choice)


def _set_parameter(target: Any, value: Any) -> None:
    """An InferParameter holding `value` (bool, int, float or text)."""
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)


def call_deadline(deadline_s: float | None, context: Any) -> float | None:
    """The request's deadline: `parameters.deadline_ms` when given, else the call's own (`grpc-timeout`,
    what `context.time_remaining()` says is left; None when the client set none)."""
    if deadline_s is not None or context is None:
        return deadline_s
    left = context.time_remaining() if callable(getattr(context, "time_remaining", None)) else None
    return None if left is None else max(float(left), 1e-6)


def decode_inputs(request: Any, max_bytes: int) -> dict[str, Any]:
    """name -> tensor (or BYTES list) of every input, raw or typed contents, sizes checked."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise oc.OipError(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs; send one per input")
    out: dict[str, Any] = {}
    for i, tensor in enumerate(request.inputs):
        entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        name, datatype, shape, _ = oc.check_header(entry, f"inputs[{i}]")
        if name in out:
            raise oc.OipError(f"input names must be unique, {name!r} is given twice")
        if raw:
            if datatype != "BYTES" and len(raw[i]) > max_bytes:
                raise oc.OipError(f"input {name!r}: {len(raw[i])} bytes are over the limit of {max_bytes}", 413)
            out[name] = oc.from_bytes(name, datatype, shape, memoryview(raw[i]))
        else:
            field = CONTENTS.get(datatype)
            if field is None:
                raise oc.OipError(f"input {name!r}: {datatype} travels in raw_input_contents only")
            values = list(getattr(tensor.contents, field))
            if datatype == "BYTES":
                values = [v.decode("utf-8", "replace") for v in values]
            out[name] = oc.from_json(name, datatype, shape, values, max_bytes)
    return out


class OipGrpcMethods:
    """The RPCs of `inference.GRPCInferenceService` as methods of the group deployment (see module doc).

    The host class provides `runner` (GroupRunner) and `options` (ServeOptions).
    """

    runner: Any
    options: Any

    def _model(self) -> str:
        return model_name(self.options, self.runner.entry)

    def _allowed(self, context: Any) -> bool:
        keys = self.options.key_table()
        if keys is None:
            return True
        metadata = dict(context.invocation_metadata()) if context is not None else {}
        if key_matches(metadata.get("authorization"), keys):
            return True
        fail(context, 401, "missing or wrong API key; send the metadata 'authorization: Bearer <key>'")
        return False

    def _known(self, name: str, version: str, context: Any) -> bool:
        problem = unknown_model(name, version, self._model())
        if problem is None:
            return True
        fail(context, 404, problem)
        return False

    async def ServerLive(self, request: Any, grpc_context: Any = None) -> Any:
        return pb().ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, grpc_context: Any = None) -> Any:
        return pb().ServerReadyResponse(ready=self.runner.ready)

    async def ServerMetadata(self, request: Any, grpc_context: Any = None) -> Any:
        if not self._allowed(grpc_context):
            return pb().ServerMetadataResponse()
        return pb().ServerMetadataResponse(name="phyai-ray", version=__version__, extensions=EXTENSIONS)

    async def ModelReady(self, request: Any, grpc_context: Any = None) -> Any:
        if not self._allowed(grpc_context) or not self._known(request.name, request.version, grpc_context):
            return pb().ModelReadyResponse()
        return pb().ModelReadyResponse(ready=self.runner.ready)

    async def ModelMetadata(self, request: Any, grpc_context: Any = None) -> Any:
        messages = pb()
        if not self._allowed(grpc_context) or not self._known(request.name, request.version, grpc_context):
            return messages.ModelMetadataResponse()
        spec = messages.ModelMetadataResponse.TensorMetadata
        meta = model_metadata(self.runner.entry, self._model())
        return messages.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[spec(**s) for s in meta["inputs"]], outputs=[spec(**s) for s in meta["outputs"]])

    async def ModelInfer(self, request: Any, grpc_context: Any = None) -> Any:
        messages = pb()
        if not self._allowed(grpc_context) or not self._known(request.model_name, request.model_version,
                                                               grpc_context):
            return messages.ModelInferResponse()
        received_at = time.time()
        try:  # validated once, in _decode
            plugin_request, deadline_s, late = await asyncio.to_thread(self._decode, request)
            deadline_s = call_deadline(deadline_s, grpc_context)
            timing: dict[str, Any] = {}
            result = await self.runner.run(plugin_request, deadline_s=deadline_s, timing=timing, late=late)
            response = await asyncio.to_thread(self._encode, request, result)
            for name, value in reply_parameters(timing, deadline_s, received_at).items():
                _set_parameter(response.parameters[name], value)
            return response
        except oc.OipError as exc:
            fail(grpc_context, exc.status, str(exc))
        except Exception as exc:  # the plugin's refusal, an engine error (its row of the failure table), a fault
            failure = classify(exc, overload_status=self.options.overload_status, rejected_status=BAD_REQUEST)
            fail(grpc_context, failure.status, failure.message)
        return messages.ModelInferResponse()

    def _decode(self, request: Any) -> tuple[Validated, float | None, str | None]:
        entry = self.runner.entry
        check_signature(entry, {t.name: (t.datatype, list(t.shape)) for t in request.inputs})
        plugin_request = decode_inputs(request, self.options.max_tensor_bytes)
        params = {k: parameter(v) for k, v in request.parameters.items()}
        deadline_s, late = request_deadline(params), request_late(params)
        return finish_request(plugin_request, params, entry), deadline_s, late

    def _encode(self, request: Any, result: Any) -> Any:
        messages = pb()
        values = named_outputs(result, self.runner.entry)
        wanted = [o.name for o in request.outputs] or list(values)
        missing_outputs(wanted, values)
        response = messages.ModelInferResponse(model_name=self._model(), model_version=VERSION,
                                               id=request.id or uuid.uuid4().hex)
        for name in wanted:
            out, raw = oc.to_output(name, values[name], binary=True)
            response.outputs.add(name=name, datatype=out["datatype"], shape=out["shape"])
            response.raw_output_contents.append(raw)
        return response
