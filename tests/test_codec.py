"""The tensor JSON codec: round trips (hypothesis) and error messages that name the place.

Run: .venv/bin/pytest tests/test_codec.py -q
"""

from __future__ import annotations

import base64
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phyai_ray.errors import PhyAIError
from phyai_ray.serve.protocols.codec import DTYPES, TENSOR_KEY, CodecError, decode, encode

shapes = st.lists(st.integers(min_value=0, max_value=4), min_size=0, max_size=4)


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = draw(shapes)
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n, max_size=n))  # one random byte per element, then widen
    base = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    if dtype is torch.bool:
        return (base % 2).to(torch.bool).reshape(shape)
    return (base.to(torch.int16) - 128).to(dtype).reshape(shape) if dtype.is_signed else base.to(dtype).reshape(shape)


scalars = st.none() | st.booleans() | st.integers() | st.text() | st.floats(allow_nan=False, allow_infinity=False)  # non-finite: tests/test_serve_edges.py
payloads = st.recursive(
    scalars | tensors(),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text().filter(lambda k: k != TENSOR_KEY), inner, max_size=4),
    max_leaves=12)


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and b.dtype == a.dtype and b.shape == a.shape
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert type(a) is type(b) and a == b


@settings(max_examples=200, deadline=None)
@given(tensors())
def test_every_dtype_and_shape_round_trips_through_json_text(t: torch.Tensor) -> None:
    wire = json.dumps(encode(t))
    assert_same(t, decode(json.loads(wire)))


@settings(max_examples=150, deadline=None)
@given(payloads)
def test_nested_payloads_round_trip(obj) -> None:
    assert_same(obj, decode(json.loads(json.dumps(encode(obj)))))


def test_documented_example_bytes_are_little_endian_row_major() -> None:
    enc = encode(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    assert enc == {TENSOR_KEY: {"dtype": "float32", "shape": [2, 3],
                                "data": "AACAPwAAAEAAAEBAAACAQAAAoEAAAMBA"}}
    assert base64.b64decode(encode(torch.tensor([1, 256], dtype=torch.int16))[TENSOR_KEY]["data"]) == \
        b"\x01\x00\x00\x01"


def test_non_contiguous_views_and_grad_tensors_encode_their_values() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()[1:]
    assert not t.is_contiguous()
    assert torch.equal(decode(encode(t)), t)
    w = torch.ones(2, requires_grad=True) * 3
    assert torch.equal(decode(encode(w)), torch.full((2,), 3.0))


def test_scalar_tensor_has_empty_shape_and_tuples_become_lists() -> None:
    enc = encode({"x": (torch.tensor(7, dtype=torch.int64), 1)})
    assert enc["x"][0][TENSOR_KEY]["shape"] == []
    out = decode(enc)
    assert out["x"][0].shape == () and out["x"][0].item() == 7 and out["x"][1] == 1


def test_decoded_tensors_are_writable_and_own_their_memory() -> None:
    out = decode(encode(torch.zeros(3)))
    out += 1
    assert out.tolist() == [1.0, 1.0, 1.0]


def test_codec_error_is_a_phyai_error_and_a_value_error() -> None:
    assert issubclass(CodecError, PhyAIError) and issubclass(CodecError, ValueError)


def marker(dtype="float32", shape=(2,), data=None) -> dict:
    if data is None:
        data = base64.b64encode(bytes(4 * math.prod(shape))).decode()
    return {TENSOR_KEY: {"dtype": dtype, "shape": list(shape), "data": data}}


def decode_error(payload) -> str:
    with pytest.raises(CodecError) as info:
        decode({"inputs": [1, 2, payload]}, root="request")
    return str(info.value)


@pytest.mark.parametrize("payload, fragments", [
    (marker(dtype="complex64"), ["request.inputs[2].__tensor__.dtype", "'complex64'", "float32, float16"]),
    (marker(dtype=3), ["request.inputs[2].__tensor__.dtype", "3", "bfloat16"]),
    (marker(shape=(2, -3), data=""), ["request.inputs[2].__tensor__.shape", "[2, -3]", "[-3]", ">= 0"]),
    (marker(shape=(2,), data="AAAA"), ["request.inputs[2].__tensor__.data", "3 bytes", "shape [2] of float32",
                                       "needs exactly 8"]),
    (marker(data="!!!not base64"), ["request.inputs[2].__tensor__.data", "base64"]),
    (marker(data=7), ["request.inputs[2].__tensor__.data", "base64 string", "int"]),
    ({TENSOR_KEY: {"dtype": "float32", "shape": "2", "data": ""}}, ["shape '2'", "list of ints", "[2, 3]"]),
    ({TENSOR_KEY: {"dtype": "float32", "shape": [True], "data": ""}}, ["list of ints"]),
    ({TENSOR_KEY: {"dtype": "float32", "shape": [1]}}, ["request.inputs[2].__tensor__", "['dtype', 'shape']",
                                                        "'data'"]),
    ({TENSOR_KEY: [1, 2]}, ["exactly the keys", "list"]),
    ({TENSOR_KEY: {}, "extra": 1}, ["request.inputs[2]:", "['extra']", "single key"]),
    (marker(dtype="bool", shape=(2,), data=base64.b64encode(b"\x01\x02").decode()), ["0 or 1"]),
])
def test_bad_tensor_objects_name_path_values_and_expected_form(payload, fragments) -> None:
    message = decode_error(payload)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_size_limit_is_checked_before_decoding_data() -> None:
    huge = {TENSOR_KEY: {"dtype": "float64", "shape": [10**6, 10**6], "data": ""}}
    message = decode_error(huge)
    assert "8000000000000 bytes" in message and "limit" in message
    with pytest.raises(CodecError, match="over the limit of 16 bytes"):
        decode(marker(dtype="float32", shape=(5,)), max_bytes=16)
    assert decode(marker(dtype="float32", shape=(4,)), max_bytes=16).shape == (4,)


def test_oversized_base64_text_is_rejected_before_decoding() -> None:
    message = decode_error(marker(shape=(1,), data="A" * 1000))
    assert "1000 base64 characters" in message


def test_nesting_depth_is_limited() -> None:
    deep: list = []
    for _ in range(10):
        deep = [deep]
    with pytest.raises(CodecError, match="deeper than 5"):
        decode(deep, max_depth=5)


@pytest.mark.parametrize("obj, fragments", [
    ({"x": [object()]}, ["payload.x[0]", "builtins.object", "torch.Tensor"]),
    ({"x": torch.zeros(2, dtype=torch.complex64)}, ["payload.x", "torch.complex64", "bfloat16"]),
    ({1: 2}, ["dict key 1", "must be str"]),
    ({"a": {TENSOR_KEY: 1}}, ["payload.a", "reserved"]),
    ({"a b": {"c": torch.zeros(2).to_sparse()}}, ["payload['a b'].c", "to_dense"]),
])
def test_encode_errors_name_the_path(obj, fragments) -> None:
    with pytest.raises(CodecError) as info:
        encode(obj)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_decode_never_unpickles() -> None:
    import pickle
    blob = base64.b64encode(pickle.dumps(torch.zeros(2))).decode()
    with pytest.raises(CodecError):
        decode({TENSOR_KEY: {"dtype": "float32", "shape": [2], "data": blob}})


def test_a_token_plugins_result_encodes_as_its_fields() -> None:
    from phyai_ray.outputs import TokenOutput

    out = TokenOutput([5, 7], [-0.5, -1.25], stop_reason="completed", weight_version=3, weight_versions=[3, 3],
                      text="hi", top_logprobs=[{5: -0.5, 2: -1.0}, {7: -1.25}])
    [encoded] = encode([out], root="result")
    assert json.loads(json.dumps(encoded)) == encoded
    assert encoded["token_ids"] == [5, 7] and encoded["log_probs"] == [-0.5, -1.25] and encoded["text"] == "hi"
    assert encoded["weight_versions"] == [3, 3] and encoded["stop_reason"] == "completed"
    assert encoded["top_logprobs"] == [{"5": -0.5, "2": -1.0}, {"7": -1.25}]
