"""Tensors of the Open Inference Protocol v2 (KServe / Triton): JSON data and the binary tensor extension.

    {"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]}                 JSON
    {"name": "x", "datatype": "FP32", "shape": [2, 2], "parameters": {"binary_data_size": 16}}  binary

A binary input's bytes follow the JSON header in the body (`Inference-Header-Content-Length` says
where the header ends), in the order of the inputs: row-major, little-endian, BOOL one byte per
element, BYTES as a 4-byte little-endian length before each element. A BYTES input reaches the
plugin as a flat list of its elements, each a str when it is UTF-8 text, else bytes. Every count is checked
against the shape before anything is allocated; an error is an `OipError` with its HTTP status
(400: the request is at fault) and a message that names the tensor and the values.
"""

from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

TORCH_TYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "UINT16": torch.uint16, "UINT32": torch.uint32,
    "UINT64": torch.uint64, "INT8": torch.int8, "INT16": torch.int16, "INT32": torch.int32, "INT64": torch.int64,
    "FP16": torch.float16, "BF16": torch.bfloat16, "FP32": torch.float32, "FP64": torch.float64,
}
DATATYPE_NAMES = {dtype: name for name, dtype in TORCH_TYPES.items()}
KNOWN = (*TORCH_TYPES, "BYTES")
MAX_DIMS = 32
MAX_DEPTH = 64


class OipError(Exception):
    """A request or result the protocol cannot carry; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Tensor:
    """One decoded input: a CPU tensor, or for BYTES a flat list (str when UTF-8, else bytes)."""

    name: str
    datatype: str
    shape: list[int]
    value: Any


def itemsize(datatype: str) -> int:
    return torch.empty((), dtype=TORCH_TYPES[datatype]).element_size()


def check_header(entry: Any, where: str) -> tuple[str, str, list[int], dict[str, Any]]:
    """(name, datatype, shape, parameters) of one tensor object, each checked."""
    if not isinstance(entry, dict):
        raise OipError(f"{where}: expected an object {{name, datatype, shape, data}}, got {type(entry).__name__}")
    name, datatype, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
    if not isinstance(name, str) or not name:
        raise OipError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    if datatype not in KNOWN:
        raise OipError(f"input {name!r}: unknown datatype {datatype!r}; expected one of {', '.join(KNOWN)}")
    ok = isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    if not ok or len(shape) > MAX_DIMS:
        raise OipError(f"input {name!r}: shape {shape!r} must be a list of at most {MAX_DIMS} ints >= 0")
    parameters = entry.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise OipError(f"input {name!r}: 'parameters' must be an object, got {type(parameters).__name__}")
    return name, datatype, shape, parameters


def from_json(name: str, datatype: str, shape: list[int], data: Any, max_bytes: int) -> Any:
    """The tensor (or BYTES list) of a JSON `data` field: flat or nested row-major values."""
    count = math.prod(shape)
    if datatype != "BYTES" and count * itemsize(datatype) > max_bytes:
        raise OipError(f"input {name!r}: shape {shape} of {datatype} is {count * itemsize(datatype)} bytes, over "
                       f"the limit of {max_bytes} bytes; send less (or raise --max-tensor-bytes)", 413)
    flat = _flatten(data, name)
    if len(flat) != count:
        raise OipError(f"input {name!r}: shape {shape} needs {count} elements, but 'data' holds {len(flat)}")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise OipError(f"input {name!r}: BYTES data in JSON must be strings")
        return flat
    want = bool if datatype == "BOOL" else (float if datatype in ("FP16", "BF16", "FP32", "FP64") else int)
    found = set(map(type, flat))  # one pass; exact types, so a bool is not taken for an int
    if not found <= ({float, int} if want is float else {want}):
        raise OipError(f"input {name!r}: {datatype} data must be {want.__name__} values; found "
                       f"{sorted(t.__name__ for t in found)}")
    try:
        return torch.tensor(flat, dtype=TORCH_TYPES[datatype]).reshape(shape)
    except (OverflowError, RuntimeError, TypeError) as exc:
        raise OipError(f"input {name!r}: data does not fit {datatype}: {exc}") from None


def _flatten(data: Any, name: str) -> list[Any]:
    if not isinstance(data, list):
        raise OipError(f"input {name!r}: 'data' must be a list (flat or nested, row-major), got {type(data).__name__}")
    if not any(isinstance(v, list) for v in data):
        return data  # already flat: the common case, and the fast one
    out: list[Any] = []
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, list):
            if depth > MAX_DEPTH:
                raise OipError(f"input {name!r}: 'data' is nested deeper than {MAX_DEPTH} levels")
            stack.extend((v, depth + 1) for v in reversed(item))
        else:
            out.append(item)
    return out


def from_bytes(name: str, datatype: str, shape: list[int], raw: memoryview) -> Any:
    """The tensor (or BYTES list) of one binary input; `raw` holds exactly its declared bytes."""
    count = math.prod(shape)
    if datatype == "BYTES":
        return _split_bytes(name, shape, count, raw)
    expected = count * itemsize(datatype)
    if len(raw) != expected:
        raise OipError(f"input {name!r}: shape {shape} of {datatype} is {count} elements x {itemsize(datatype)} "
                       f"bytes = {expected} bytes, but binary_data_size is {len(raw)}")
    if expected == 0:
        return torch.empty(shape, dtype=TORCH_TYPES[datatype])
    u8 = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if sys.byteorder != "little" and itemsize(datatype) > 1:
        u8 = u8.reshape(-1, itemsize(datatype)).flip(-1).reshape(-1)
    if datatype == "BOOL" and bool((u8 > 1).any()):
        raise OipError(f"input {name!r}: BOOL elements must be bytes 0 or 1")
    return u8.view(TORCH_TYPES[datatype]).reshape(shape)


def _split_bytes(name: str, shape: list[int], count: int, raw: memoryview) -> list[bytes]:
    items, at = [], 0
    for i in range(count):
        if at + 4 > len(raw):
            raise OipError(f"input {name!r}: BYTES element {i} of {count} (shape {shape}) has no length prefix; "
                           f"the binary data ends at byte {len(raw)}")
        (size,) = struct.unpack_from("<I", raw, at)
        if at + 4 + size > len(raw):
            raise OipError(f"input {name!r}: BYTES element {i} declares {size} bytes, past the end of its data")
        items.append(_text(bytes(raw[at + 4:at + 4 + size])))
        at += 4 + size
    if at != len(raw):
        raise OipError(f"input {name!r}: {len(raw) - at} bytes left after the {count} BYTES elements of shape {shape}")
    return items


def _text(item: bytes) -> str | bytes:
    """A BYTES element as str when it is UTF-8 (what plugins take for text), else the raw bytes."""
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError:
        return item


def to_output(name: str, value: Any, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    """One output object and, when `binary`, its bytes (to follow the JSON header)."""
    datatype, shape, tensor = _as_output(name, value)
    out: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
    if datatype == "BYTES":
        items = [v if isinstance(v, bytes) else str(v).encode() for v in tensor]
        if not binary:
            out["data"] = [v.decode("utf-8", "replace") for v in items]
            return out, None
        raw = b"".join(struct.pack("<I", len(v)) + v for v in items)
    elif not binary:
        out["data"] = tensor.reshape(-1).tolist() if datatype not in ("FP16", "BF16") else \
            tensor.float().reshape(-1).tolist()
        return out, None
    else:
        flat = tensor.reshape(-1).view(torch.uint8)
        if sys.byteorder != "little" and tensor.element_size() > 1:
            flat = flat.reshape(-1, tensor.element_size()).flip(-1).reshape(-1)
        raw = flat.numpy().tobytes()
    out["parameters"] = {"binary_data_size": len(raw)}
    return out, raw


def _as_output(name: str, value: Any) -> tuple[str, list[int], Any]:
    if isinstance(value, (str, bytes)) or (isinstance(value, list) and value and
                                            all(isinstance(v, (str, bytes)) for v in value)):
        items = [value] if isinstance(value, (str, bytes)) else list(value)
        return "BYTES", [len(items)], items
    tensor = value if isinstance(value, torch.Tensor) else _tensor_of(name, value)
    tensor = tensor.detach().to("cpu").contiguous()
    datatype = DATATYPE_NAMES.get(tensor.dtype)
    if datatype is None:
        raise OipError(f"output {name!r}: dtype {tensor.dtype} has no Open Inference Protocol datatype", 500)
    return datatype, list(tensor.shape), tensor


def _tensor_of(name: str, value: Any) -> torch.Tensor:
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise OipError(f"output {name!r}: a {type(value).__name__} cannot be sent as a tensor: {exc}", 500) from None
