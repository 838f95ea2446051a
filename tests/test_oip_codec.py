"""Open Inference Protocol tensors and signatures, without a server: pure unit tests (no Ray).

Run: .venv/bin/pytest tests/test_oip_codec.py -q

Binary bodies are built here byte by byte the way the protocol's binary tensor extension lays
them out (JSON header, then each input's row-major little-endian bytes), so the decoder is
checked against the layout, not against itself. The real client (`tritonclient`) is exercised
against a real server in tests/test_oip.py.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from phyai_ray.plugins.signature import SignatureError, TensorSpec, check_inputs
from phyai_ray.serve.protocols.oip import tensors as oc
from phyai_ray.serve.protocols.oip.routes import parse_infer, respond
from phyai_ray.serve.runtime.options import ServeOptions

NUMERIC = {"BOOL": torch.bool, "UINT8": torch.uint8, "UINT16": torch.uint16, "UINT32": torch.uint32,
           "UINT64": torch.uint64, "INT8": torch.int8, "INT16": torch.int16, "INT32": torch.int32,
           "INT64": torch.int64, "FP16": torch.float16, "BF16": torch.bfloat16, "FP32": torch.float32,
           "FP64": torch.float64}
STRUCT = {"BOOL": "?", "UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q", "INT8": "b", "INT16": "h",
          "INT32": "i", "INT64": "q", "FP16": "e", "FP32": "f", "FP64": "d"}
VALUES = [1, 0, 1, 1, 0, 1]


class AnyEntry:
    """Fake entry (no signature, accepts every request), for the request-mapping tests."""

    inputs: tuple = ()
    outputs: tuple = ()

    def validate_request(self, request: object) -> None:
        pass


class SignedEntry(AnyEntry):
    inputs = (TensorSpec("x", "FP32", (-1, 3)),)
    outputs = (TensorSpec("y", "FP32", (-1,)),)


def binary_body(inputs: list[tuple[str, str, list[int], bytes]], **header: object) -> tuple[bytes, str]:
    """(body, Inference-Header-Content-Length) of a binary request."""
    head = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": s, "parameters": {"binary_data_size": len(b)}}
                                  for n, d, s, b in inputs], **header}).encode()
    return head + b"".join(b for *_, b in inputs), str(len(head))


@pytest.mark.parametrize("datatype", [d for d in NUMERIC if d != "BF16"])
def test_every_numeric_datatype_decodes_from_little_endian_bytes_and_from_json(datatype: str) -> None:
    raw = struct.pack("<" + STRUCT[datatype] * 6, *VALUES)
    got = oc.from_bytes("x", datatype, [2, 3], memoryview(raw))
    assert got.dtype == NUMERIC[datatype] and list(got.shape) == [2, 3]
    assert got.to(torch.float64).reshape(-1).tolist() == VALUES
    data = [bool(v) for v in VALUES] if datatype == "BOOL" else \
        [float(v) for v in VALUES] if datatype.startswith("FP") else VALUES
    assert torch.equal(oc.from_json("x", datatype, [2, 3], [data[:3], data[3:]], 1 << 20), got)


def test_bf16_is_the_upper_half_of_fp32_and_round_trips_in_both_forms() -> None:
    values = [1.0, -2.5, 0.15625]
    raw = b"".join(struct.pack("<f", v)[2:] for v in values)  # bfloat16: the high 16 bits of a float32
    got = oc.from_bytes("x", "BF16", [3], memoryview(raw))
    assert got.dtype == torch.bfloat16 and got.float().tolist() == values
    out, data = oc.to_output("y", got, binary=True)
    assert out == {"name": "y", "datatype": "BF16", "shape": [3], "parameters": {"binary_data_size": 6}}
    assert data == raw
    assert oc.to_output("y", got, binary=False)[0]["data"] == values


def test_bytes_elements_are_length_prefixed_and_reach_the_plugin_as_text() -> None:
    raw = b"".join(struct.pack("<I", len(s)) + s for s in (b"pick", b"", b"\xff\xfe"))
    assert oc.from_bytes("s", "BYTES", [3], memoryview(raw)) == ["pick", "", b"\xff\xfe"]
    out, data = oc.to_output("s", ["pick", "place"], binary=True)
    assert out["datatype"] == "BYTES" and out["shape"] == [2] and data == b"\x04\0\0\0pick\x05\0\0\0place"
    with pytest.raises(oc.OipError, match="past the end"):
        oc.from_bytes("s", "BYTES", [1], memoryview(struct.pack("<I", 9) + b"abc"))


def test_a_shape_that_does_not_match_the_bytes_is_refused_before_allocating() -> None:
    with pytest.raises(oc.OipError, match=r"shape \[2, 3\] of FP32 is 6 elements x 4 bytes = 24 bytes, but "
                                          r"binary_data_size is 20"):
        oc.from_bytes("x", "FP32", [2, 3], memoryview(bytes(20)))
    with pytest.raises(oc.OipError, match="over the limit") as info:  # 4 TB: refused from the shape alone
        oc.from_json("x", "FP32", [1 << 20, 1 << 20], [], max_bytes=1 << 30)
    assert info.value.status == 413
    with pytest.raises(oc.OipError, match=r"needs 6 elements, but 'data' holds 5"):
        oc.from_json("x", "INT32", [2, 3], [1, 2, 3, 4, 5], 1 << 20)


@pytest.mark.parametrize("entry, message", [
    ({"name": "x", "datatype": "FP8", "shape": [1], "data": [1]}, "unknown datatype 'FP8'"),
    ({"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}, "shape \\[-1\\] must be"),
    ({"name": "x", "datatype": "INT32", "shape": [1], "data": [1.5]}, "must be int values"),
    ({"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}, "must be float values"),
    ({"name": "x", "datatype": "BOOL", "shape": [1], "data": [1]}, "must be bool values"),
    ({"datatype": "FP32", "shape": [1], "data": [1]}, "'name' must be"),
])
def test_bad_json_tensors_get_a_400_that_names_the_problem(entry: dict, message: str) -> None:
    body = json.dumps({"inputs": [entry]}).encode()
    with pytest.raises(oc.OipError, match=message) as info:
        parse_infer(body, None, AnyEntry(), ServeOptions())
    assert info.value.status == 400


def test_a_truncated_binary_body_is_refused_with_the_sizes() -> None:
    body, length = binary_body([("x", "FP32", [2, 3], struct.pack("<6f", *VALUES))])
    with pytest.raises(oc.OipError, match=r"declare 24 bytes .* holds 20 after the header; the body is truncated"):
        parse_infer(body[:-4], length, AnyEntry(), ServeOptions())
    with pytest.raises(oc.OipError, match="Inference-Header-Content-Length is 9999"):
        parse_infer(body, "9999", AnyEntry(), ServeOptions())


def test_inputs_and_parameters_become_the_plugins_request() -> None:
    body, length = binary_body([("x", "FP32", [2, 3], struct.pack("<6f", *VALUES))],
                               parameters={"scale": 2.0, "binary_data_output": True}, id="r-1")
    parsed = parse_infer(body, length, AnyEntry(), ServeOptions())
    request = parsed.request.request  # validated once, in the form the plugin runs
    assert set(request) == {"x", "scale"} and request["scale"] == 2.0
    assert request["x"].tolist() == [[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]
    assert parsed.binary and parsed.id == "r-1" and parsed.outputs is None


def test_a_tensor_result_is_one_output_named_by_the_signature_and_binary_when_asked() -> None:
    class Runner:
        entry = SignedEntry()

    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}],
                       "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    parsed = parse_infer(body, None, SignedEntry(), ServeOptions())
    response = respond(parsed, torch.tensor([0.5, 1.5]), "m", "req-7", Runner())
    size = int(response.headers["inference-header-content-length"])
    header = json.loads(response.body[:size])
    assert header == {"model_name": "m", "model_version": "1", "id": "req-7", "outputs": [
        {"name": "y", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}]}
    assert response.body[size:] == struct.pack("<2f", 0.5, 1.5)


def test_signatures_check_names_datatypes_and_shapes_with_wildcards() -> None:
    specs = (TensorSpec("x", "FP32", (-1, 3)), TensorSpec("m", "BOOL", (-1,), optional=True))
    check_inputs(specs, {"x": ("FP32", [7, 3])})
    for given, message in (({"x": ("FP32", [7, 4])}, r"shape \[7, 4\], but the model expects \[-1, 3\]"),
                           ({"x": ("FP16", [7, 3])}, "datatype FP16, but the model expects FP32"),
                           ({"m": ("BOOL", [2])}, r"missing input\(s\) \['x'\]"),
                           ({"x": ("FP32", [1, 3]), "z": ("FP32", [1])}, r"unknown input\(s\) \['z'\]")):
        with pytest.raises(SignatureError, match=message):
            check_inputs(specs, given)
    check_inputs((), {"anything": ("FP32", [1])})  # no signature: every named tensor goes to the plugin
    with pytest.raises(ValueError, match="FP8"):
        TensorSpec("x", "FP8", (1,))
