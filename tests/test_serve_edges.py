"""Edge cases of the HTTP edge found by review, each a unit of the real code (no server, no Ray):
an empty tensor with a huge dimension, a non-ASCII API key, a non-finite float in a result, the
one failure table as each protocol renders it, and a JSON header nested as a hostile client would.

Run: `.venv/bin/pytest tests/test_serve_edges.py`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from phyai_ray.errors import EngineOverloadedError, EngineUnavailableError, RequestRejectedError, RequestTimeoutError
from phyai_ray.serve.protocols import codec
from phyai_ray.serve.protocols.oip import tensors as oc
from phyai_ray.serve.protocols.error_map import HttpError, classify, from_engine_error
from phyai_ray.serve.protocols.guard import EdgeGuard, key_matches
from phyai_ray.serve.protocols.oip.routes import _split
from phyai_ray.serve.protocols.oip.servicer import _CODES
from phyai_ray.serve.protocols.oip.model import BAD_REQUEST
from phyai_ray.serve.protocols.openai.common import openai_error
from phyai_ray.serve.runtime.runner import SubmitFault


@pytest.mark.parametrize("shape", [[0, 2 ** 63], [2 ** 62, 0, 4], [0] + [2 ** 31] * 3])
def test_an_empty_tensor_with_a_huge_dimension_is_a_codec_error(shape):
    with pytest.raises(codec.CodecError, match=r"payload.shape: .* dimensions"):
        codec.decode_tensor({"dtype": "float32", "shape": shape, "data": ""})
    assert codec.decode_tensor({"dtype": "float32", "shape": [0, 4096], "data": ""}).shape == (0, 4096)


def test_a_non_ascii_api_key_matches_the_header_a_client_sends():
    key = "clé-ключ-鍵"
    guard = EdgeGuard(None, keys={key: "default"}, max_body_bytes=1024)
    sent = f"Bearer {key}".encode()  # what an HTTP client writes (UTF-8 bytes)
    assert guard._check_key(sent.decode("latin-1")) == "default"  # what the guard reads from the ASGI scope
    with pytest.raises(HttpError):
        guard._check_key("Bearer " + "clé-ключ-鍶".encode().decode("latin-1"))


def test_several_keys_name_their_tenants_and_api_key_is_tenant_default():
    from phyai_ray.serve.runtime.options import ServeOptions

    options = ServeOptions(api_key="k-ops", api_keys={"lab-a": "k-a", "lab-b": "k-b"})
    guard = EdgeGuard(None, keys=options.key_table(), max_body_bytes=1024)
    assert [guard._check_key(f"Bearer {k}") for k in ("k-a", "k-b", "k-ops")] == ["lab-a", "lab-b", "default"]
    for wrong in ("Bearer k-c", "Basic k-a", ""):
        with pytest.raises(HttpError):
            guard._check_key(wrong)
    assert ServeOptions().key_table() is None and EdgeGuard(None, keys=None, max_body_bytes=1)._check_key("") is None
    with pytest.raises(ValueError, match="two tenants share a key"):
        ServeOptions(api_keys={"a": "same", "b": "same"})


def test_non_finite_floats_in_a_result_travel_as_scalar_tensors():
    result = {"loss": float("nan"), "scores": [1.5, float("inf"), -float("inf")]}
    text = json.dumps(codec.encode(result, root="result"), allow_nan=False)  # strict JSON, as the app answers
    back = codec.decode(json.loads(text))
    assert math.isnan(back["loss"].item()) and back["scores"][0] == 1.5
    assert back["scores"][1].item() == math.inf and back["scores"][2].item() == -math.inf


def test_the_openai_route_answers_overload_with_retry_after():
    response = openai_error(EngineOverloadedError("full", queued=4, limit=4)).response()
    assert response.status_code == 503 and response.headers["retry-after"] == "1"


TABLE = [  # (exception, status, kind, Retry-After, gRPC code)
    (EngineOverloadedError("full"), 503, "overloaded", True, "UNAVAILABLE"),
    (RequestTimeoutError("late"), 504, "timeout", False, "DEADLINE_EXCEEDED"),
    (EngineUnavailableError("hung", reason="timeout"), 504, "timeout", False, "DEADLINE_EXCEEDED"),
    (EngineUnavailableError("raised", reason="exception"), 500, "execution_error", False, "INTERNAL"),
    (EngineUnavailableError("gone", reason="worker_exit"), 503, "unavailable", True, "UNAVAILABLE"),
    (SubmitFault("bug"), 500, "internal", False, "INTERNAL"),
    (ValueError("the plugin raised"), 500, "execution_error", False, "INTERNAL"),
]


@pytest.mark.parametrize("exc,status,kind,retry,code", TABLE, ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None)
def test_every_protocol_renders_the_one_failure_table(exc, status, kind, retry, code):
    failure = classify(exc)
    assert (failure.status, failure.kind, failure.retry_after) == (status, kind, retry)
    http = from_engine_error(exc)
    assert (http.status_code, http.type, "Retry-After" in (http.headers or {})) == (status, kind, retry)
    openai = openai_error(exc)
    assert openai.status == status and (openai.headers is not None) == retry
    assert openai.type == {"overloaded": "overloaded_error", "timeout": "timeout_error"}.get(kind, "server_error")
    assert _CODES.get(status, "INTERNAL") == code
    if isinstance(exc, EngineOverloadedError):  # --overload-status 429 reaches every protocol alike
        assert classify(exc, overload_status=429).status == openai_error(exc, overload_status=429).status == 429


def test_a_rejection_is_each_protocols_bad_request_with_the_plugins_message():
    exc = RequestRejectedError("plugin p rejected the request: ValueError: x must hold 8 numbers", plugin="p",
                               field="x")
    failure = classify(exc)
    assert (failure.status, failure.kind, failure.retry_after, failure.param) == (422, "rejected", False, "x")
    http = from_engine_error(exc)
    assert (http.status_code, http.type) == (422, "rejected") and "8 numbers" in http.detail
    assert _CODES[classify(exc, rejected_status=BAD_REQUEST).status] == "INVALID_ARGUMENT"  # OIP, gRPC too
    openai = openai_error(exc)
    assert (openai.status, openai.type, openai.param) == (400, "invalid_request_error", "x")
    assert "8 numbers" in str(openai)


def test_one_key_check_for_every_protocol():
    assert key_matches(None, None) and key_matches("anything", None)
    assert key_matches("Bearer s3cret", "s3cret") and key_matches("bearer  s3cret ", "s3cret")
    assert not key_matches("Bearer wrong", "s3cret") and not key_matches(None, "s3cret")
    assert not key_matches("Api-Key s3cret", "s3cret")  # openpi's scheme only where openpi asks for it
    assert key_matches("Api-Key s3cret", "s3cret", ("api-key", "bearer"))


def test_a_deeply_nested_inference_header_is_a_bad_request_not_a_server_fault():
    depth = 5000
    body = ('{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ' + "[" * depth + "1" +
            "]" * depth + "}]}").encode()
    with pytest.raises(oc.OipError, match="nested too deeply") as caught:
        _split(body, None)
    assert caught.value.status == 400
