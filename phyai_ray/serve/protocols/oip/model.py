"""The Open Inference Protocol's model, beneath both of its transports (`routes.py` HTTP, `servicer.py` gRPC).

    model_name(options, entry)            the protocol's model name: `model_name`, else the plugin's served name
    unknown_model(name, version, model)   None, or the error text of a name / version this server does not serve
    check_signature(entry, given)         inputs' names, datatypes and shapes against `Entry.inputs`
    finish_request(request, params, entry)  request parameters (not the reserved ones) in, validated once
    request_deadline(params)              parameters.deadline_ms (the request's own deadline) in seconds, or None
    request_late(params)                  parameters.late ("finish" / "drop"), or None: the deployment's default
    reply_parameters(timing, d, received) the response parameters: queue_ms, infer_ms, batch_size, deadline_ms,
                                          deadline_met, and received_at / sent_at (Unix seconds) when `received`
    named_outputs(result, entry)          the plugin's result as output name -> value

Every error is an `OipError` (400 unless it says otherwise) but the plugin's refusal, a
`RequestRejectedError` that each transport answers 400 through the failure table
(`classify(exc, rejected_status=BAD_REQUEST)`); each renders it in its own shape.
"""

from __future__ import annotations

from typing import Any

from phyai_ray.plugins.signature import SignatureError, check_inputs
from phyai_ray.serve.protocols.oip.tensors import OipError
from phyai_ray.serve.protocols.timing import deadline_ms, freshness, late_mode, timing_fields
from phyai_ray.validation import Validated, validate

RESERVED = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers",
                      "binary_data_output", "deadline_ms", "late"})
VERSION = "1"
BAD_REQUEST = 400  # the protocol's status for a request at fault, the plugin's refusal included
EXTENSIONS = ["binary_tensor_data"]


def model_name(options: Any, entry: Any) -> str:
    return options.model_name or entry.served_name()


def unknown_model(name: str, version: str | None, model: str) -> str | None:
    """The error text when `name` / `version` ("" or None: any) is not what this server serves."""
    if name == model and version in (None, "", VERSION):
        return None
    shown = name if not version else f"{name} version {version}"
    return f"unknown model {shown!r}; this server serves {model!r} (version {VERSION})"


def model_metadata(entry: Any, model: str) -> dict[str, Any]:
    """Model metadata: the plugin's signature (`Entry.inputs` / `Entry.outputs`)."""
    return {"name": model, "versions": [VERSION], "platform": "phyai-ray",
            "inputs": [s.metadata() for s in entry.inputs], "outputs": [s.metadata() for s in entry.outputs]}


def check_signature(entry: Any, given: dict[str, tuple[str, list[int]]]) -> None:
    """The plugin's signature against the inputs' names, datatypes and shapes (400 when they do not fit)."""
    try:
        check_inputs(entry.inputs, given)
    except SignatureError as exc:
        raise OipError(str(exc)) from None


def finish_request(request: dict[str, Any], params: dict[str, Any], entry: Any) -> Validated:
    """Add the request `parameters` (not the protocol's reserved ones), then validate it once
    (`RequestRejectedError` when the plugin refuses it)."""
    clash = sorted(set(params) & set(request))
    if clash:
        raise OipError(f"parameter(s) {clash} have the names of inputs; rename one")
    request.update({k: v for k, v in params.items() if k not in RESERVED})
    return validate(entry, request)


def request_deadline(params: dict[str, Any]) -> float | None:
    try:
        return deadline_ms(params.get("deadline_ms"), "parameters.deadline_ms")
    except ValueError as exc:
        raise OipError(str(exc)) from None


def request_late(params: dict[str, Any]) -> str | None:
    try:
        return late_mode(params.get("late"), "parameters.late")
    except ValueError as exc:
        raise OipError(str(exc)) from None


def reply_parameters(timing: dict[str, Any], deadline_s: float | None,
                     received_at: float | None = None) -> dict[str, Any]:
    """The request's timing as response parameters (a field without a value is left out), with when
    the server received the request and sent the reply (Unix seconds) when `received_at` is given."""
    if not timing:
        return {}
    out = {k: v for k, v in timing_fields(timing, deadline_s).items() if v is not None}
    return {**out, **freshness(received_at)} if received_at is not None else out


def named_outputs(result: Any, entry: Any) -> dict[str, Any]:
    """The plugin's result as output name -> value: a dict per key, anything else one output."""
    if isinstance(result, dict):
        return {str(k): v for k, v in result.items() if v is not None}
    if result is None:
        return {}
    return {entry.outputs[0].name if entry.outputs else "output": result}


def missing_outputs(wanted: Any, values: dict[str, Any]) -> None:
    """Refuse outputs asked for that the model does not give."""
    missing = sorted(set(wanted) - set(values))
    if missing:
        raise OipError(f"requested output(s) {missing} are not produced; the model gives {sorted(values)}")
