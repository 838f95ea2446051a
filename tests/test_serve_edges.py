"""Edge cases of the HTTP edge found by review, each a unit of the real code (no server, no Ray):
an empty tensor with a huge dimension, a non-ASCII API key, a non-finite float in a result, and
the OpenAI route's overload answer.

Run: `.venv/bin/pytest tests/test_serve_edges.py`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from phyai_ray.errors import EngineOverloadedError
from phyai_ray.serve import codec
from phyai_ray.serve.errors import HttpError
from phyai_ray.serve.guard import EdgeGuard
from phyai_ray.serve.openai_api import _mapped


@pytest.mark.parametrize("shape", [[0, 2 ** 63], [2 ** 62, 0, 4], [0] + [2 ** 31] * 3])
def test_an_empty_tensor_with_a_huge_dimension_is_a_codec_error(shape):
    with pytest.raises(codec.CodecError, match=r"payload.shape: .* dimensions"):
        codec.decode_tensor({"dtype": "float32", "shape": shape, "data": ""})
    assert codec.decode_tensor({"dtype": "float32", "shape": [0, 4096], "data": ""}).shape == (0, 4096)


def test_a_non_ascii_api_key_matches_the_header_a_client_sends():
    key = "clé-ключ-鍵"
    guard = EdgeGuard(None, api_key=key, max_body_bytes=1024)
    sent = f"Bearer {key}".encode()  # what an HTTP client writes (UTF-8 bytes)
    guard._check_key(sent.decode("latin-1"))  # what the guard reads from the ASGI scope
    with pytest.raises(HttpError):
        guard._check_key("Bearer " + "clé-ключ-鍶".encode().decode("latin-1"))


def test_non_finite_floats_in_a_result_travel_as_scalar_tensors():
    result = {"loss": float("nan"), "scores": [1.5, float("inf"), -float("inf")]}
    text = json.dumps(codec.encode(result, root="result"), allow_nan=False)  # strict JSON, as the app answers
    back = codec.decode(json.loads(text))
    assert math.isnan(back["loss"].item()) and back["scores"][0] == 1.5
    assert back["scores"][1].item() == math.inf and back["scores"][2].item() == -math.inf


def test_the_openai_route_answers_overload_with_retry_after():
    response = _mapped(EngineOverloadedError("full", queued=4, limit=4)).response()
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
