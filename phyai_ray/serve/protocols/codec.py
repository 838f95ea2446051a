"""The JSON encoding of tensors used on the HTTP edge; never pickle.

A tensor becomes an object with ONE key, `__tensor__`, holding exactly three fields:

    torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    ->
    {"__tensor__": {"dtype": "float32", "shape": [2, 3],
                    "data": "AACAPwAAAEAAAEBAAACAQAAAoEAAAMBA"}}

* `dtype`: one of DTYPES below, spelled as in torch (`"bfloat16"`, `"int64"`, `"bool"`).
* `shape`: list of non-negative ints; `[]` is a 0-d (scalar) tensor, `[0, 4]` an empty one.
* `data`: standard base64 (RFC 4648, with padding) of the elements in row-major (C) order,
  each little-endian; `bool` is one byte per element (0 or 1). Its decoded length must be
  exactly `prod(shape) * itemsize` bytes.

Everything else is plain JSON: dicts with string keys, lists, str, int, float, bool and None
pass through, except a float that is NaN or infinite: JSON cannot carry it, so it travels as a
0-d float64 tensor (and decodes as one). Tuples encode as lists (and decode as lists). A user dict may not use the
reserved key `__tensor__`. Tensors are detached, moved to CPU and made contiguous first. A token
plugin's `TokenOutput` encodes as its fields (`to_dict`: token ids, log-probs, text, weight
versions; each token's `top_logprobs` keyed by the token id as a string).

`decode` is meant for untrusted input: it checks every field before allocating, limits the
bytes of one tensor (`max_bytes`), the tensors of the whole payload (`max_tensors`, and their
bytes together, `max_total_bytes`) and the nesting depth (`max_depth`), and raises `CodecError`
naming the place in the payload, e.g. `request.inputs[2].__tensor__.shape: ...`.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from typing import Any

import torch

from phyai_ray.errors import PhyAIError
from phyai_ray.outputs import TokenOutput

TENSOR_KEY = "__tensor__"
FIELDS = ("dtype", "shape", "data")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "float64": torch.float64, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_DEPTH = 64
DEFAULT_MAX_TENSORS = 1024
DEFAULT_MAX_TOTAL_BYTES = 1024 * 1024 * 1024
MAX_DIMS = 32
_EXAMPLE = '{"__tensor__": {"dtype": "float32", "shape": [2, 3], "data": "<base64>"}}'


class CodecError(PhyAIError, ValueError):
    """A payload that cannot be encoded or decoded; the message names the path inside it."""


def encode(obj: Any, *, root: str = "payload") -> Any:
    """Turn nested dicts/lists/tuples of tensors and JSON scalars into JSON-able data."""
    return _encode(obj, root, 0)


class _Budget:
    """What the rest of one payload may still hold: tensors, and their bytes together."""

    def __init__(self, max_tensors: int, max_total_bytes: int) -> None:
        self.tensors, self.bytes = max_tensors, max_total_bytes
        self.max_tensors, self.max_total_bytes = max_tensors, max_total_bytes

    def spend(self, path: str, nbytes: int) -> None:
        self.tensors -= 1
        self.bytes -= nbytes
        if self.tensors < 0:
            raise CodecError(f"{path}: more than {self.max_tensors} tensors in one payload; send fewer (or "
                             "start the server with a larger --max-tensors)")
        if self.bytes < 0:
            raise CodecError(f"{path}: the payload's tensors pass {self.max_total_bytes} bytes together; send "
                             "less (or start the server with a larger --max-tensor-bytes)")


def decode(obj: Any, *, root: str = "payload", max_bytes: int = DEFAULT_MAX_BYTES,
           max_depth: int = DEFAULT_MAX_DEPTH, max_tensors: int = DEFAULT_MAX_TENSORS,
           max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> Any:
    """Reverse `encode`: rebuild tensors from `{"__tensor__": {...}}` objects (CPU tensors)."""
    return _decode(obj, root, 0, max_bytes, max_depth, _Budget(max_tensors, max_total_bytes))


def _child(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if key.isidentifier() else f"{path}[{key!r}]"


def _encode(obj: Any, path: str, depth: int) -> Any:
    if depth > DEFAULT_MAX_DEPTH:
        raise CodecError(f"{path}: nesting deeper than {DEFAULT_MAX_DEPTH} levels; flatten the payload")
    if isinstance(obj, float) and not math.isfinite(obj):  # JSON has no NaN / Infinity: a 0-d float64 tensor
        return {TENSOR_KEY: encode_tensor(torch.tensor(obj, dtype=torch.float64), path)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        return {TENSOR_KEY: encode_tensor(obj, path)}
    if isinstance(obj, (list, tuple)):
        return [_encode(v, _child(path, i), depth + 1) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return {_check_key(k, path): _encode(v, _child(path, k), depth + 1) for k, v in obj.items()}
    if isinstance(obj, TokenOutput):  # a token plugin's result: its fields; top_logprobs' ids as JSON keys
        fields = obj.to_dict()
        if "top_logprobs" in fields:
            fields["top_logprobs"] = [{str(t): lp for t, lp in top.items()} for top in fields["top_logprobs"]]
        return _encode(fields, path, depth)
    raise CodecError(f"{path}: cannot encode a {type(obj).__module__}.{type(obj).__qualname__}; expected a "
                     "torch.Tensor, dict, list, tuple, str, int, float, bool or None")


def _check_key(key: Any, path: str) -> str:
    if not isinstance(key, str):
        raise CodecError(f"{path}: dict key {key!r} is a {type(key).__name__}; JSON object keys must be str")
    if key == TENSOR_KEY:
        raise CodecError(f"{path}: the key {TENSOR_KEY!r} is reserved for encoded tensors; rename it")
    return key


def encode_tensor(tensor: torch.Tensor, path: str = "payload") -> dict[str, Any]:
    """The `{"dtype", "shape", "data"}` fields of one tensor (copied to CPU, row-major, little-endian)."""
    name = _NAMES.get(tensor.dtype)
    if name is None:
        raise CodecError(f"{path}: tensor dtype {tensor.dtype} is not supported; convert it to one of "
                         f"{', '.join(DTYPES)}")
    if tensor.layout != torch.strided:
        raise CodecError(f"{path}: tensor layout {tensor.layout} is not supported; call .to_dense() first")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = _little_endian(flat.view(torch.uint8), flat.element_size())
    data = base64.b64encode(raw.numpy().tobytes()).decode("ascii")
    return {"dtype": name, "shape": list(tensor.shape), "data": data}


def _little_endian(u8: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Bytes of each element in little-endian order (a no-op on little-endian hosts)."""
    if sys.byteorder == "little" or itemsize == 1:
        return u8
    return u8.reshape(-1, itemsize).flip(-1).reshape(-1)


def _decode(obj: Any, path: str, depth: int, max_bytes: int, max_depth: int, budget: _Budget) -> Any:
    if depth > max_depth:
        raise CodecError(f"{path}: nesting deeper than {max_depth} levels; flatten the payload")
    if isinstance(obj, list):
        return [_decode(v, _child(path, i), depth + 1, max_bytes, max_depth, budget) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if TENSOR_KEY in obj:
            return _decode_marker(obj, path, max_bytes, budget)
        return {k: _decode(v, _child(path, k), depth + 1, max_bytes, max_depth, budget) for k, v in obj.items()}
    return obj


def _decode_marker(obj: dict[str, Any], path: str, max_bytes: int, budget: _Budget) -> torch.Tensor:
    if len(obj) != 1:
        extra = sorted(k for k in obj if k != TENSOR_KEY)
        raise CodecError(f"{path}: a tensor object has the single key {TENSOR_KEY!r}, found also {extra}; "
                         f"expected {_EXAMPLE}")
    return decode_tensor(obj[TENSOR_KEY], _child(path, TENSOR_KEY), max_bytes=max_bytes, budget=budget)


def decode_tensor(fields: Any, path: str = "payload", *, max_bytes: int = DEFAULT_MAX_BYTES,
                  budget: _Budget | None = None) -> torch.Tensor:
    """Build one CPU tensor from its `{"dtype", "shape", "data"}` fields, checking each first."""
    if not isinstance(fields, dict) or set(fields) != set(FIELDS):
        got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
        raise CodecError(f"{path}: expected an object with exactly the keys {list(FIELDS)}, got {got}; "
                         f"e.g. {_EXAMPLE}")
    dtype = _check_dtype(fields["dtype"], _child(path, "dtype"))
    shape = _check_shape(fields["shape"], _child(path, "shape"))
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    spanned = math.prod(d for d in shape if d) * itemsize  # what the dimensions describe, zeros aside
    if expected == 0 and spanned > max_bytes:
        raise CodecError(f"{_child(path, 'shape')}: shape {shape} is empty, but its other dimensions describe "
                         f"{spanned} bytes, over the limit of {max_bytes} bytes per tensor; keep every "
                         "dimension within the limit")
    if expected > max_bytes:
        raise CodecError(f"{path}: shape {shape} of {fields['dtype']} is {expected} bytes, over the limit of "
                         f"{max_bytes} bytes per tensor; send smaller tensors or raise the limit")
    if budget is not None:
        budget.spend(path, expected)  # before any allocation
    form = f"shape {shape} of {fields['dtype']} ({math.prod(shape)} elements x {itemsize} bytes = {expected} bytes)"
    raw = _check_data(fields["data"], _child(path, "data"), expected, form)
    if dtype is torch.bool and raw.translate(None, b"\x00\x01"):
        raise CodecError(f"{_child(path, 'data')}: bool elements must be bytes 0 or 1, found other values")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    u8 = _little_endian(torch.frombuffer(bytearray(raw), dtype=torch.uint8), itemsize)
    return u8.view(dtype).reshape(shape)


def _check_dtype(name: Any, path: str) -> torch.dtype:
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CodecError(f"{path}: dtype {name!r} is not supported; expected one of {', '.join(DTYPES)}")
    return dtype


def _check_shape(shape: Any, path: str) -> list[int]:
    ok = isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    if not ok:
        raise CodecError(f"{path}: shape {shape!r} must be a list of ints, e.g. [2, 3] (or [] for a scalar)")
    if len(shape) > MAX_DIMS:
        raise CodecError(f"{path}: shape has {len(shape)} dimensions; at most {MAX_DIMS} are supported")
    bad = [d for d in shape if d < 0]
    if bad:
        raise CodecError(f"{path}: shape {shape} has negative dimension(s) {bad}; dimensions must be >= 0")
    return shape


def _check_data(data: Any, path: str, expected: int, form: str) -> bytes:
    if not isinstance(data, str):
        raise CodecError(f"{path}: data must be a base64 string, got a {type(data).__name__}")
    if len(data) > 4 * ((expected + 2) // 3):
        raise CodecError(f"{path}: {len(data)} base64 characters are more than {form} needs "
                         f"({4 * ((expected + 2) // 3)} characters)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CodecError(f"{path}: data is not valid standard base64 ({exc}); encode the raw little-endian "
                         "bytes with base64 and padding, e.g. base64.b64encode(buf)") from None
    if len(raw) != expected:
        raise CodecError(f"{path}: data holds {len(raw)} bytes but {form} needs exactly {expected}")
    return raw
