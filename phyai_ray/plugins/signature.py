"""`TensorSpec`: the optional signature of a plugin's tensor inputs and outputs.

    class MyEntry(Entry):
        inputs = (TensorSpec("x", "FP32", (-1, 8)),)          # -1: any size along that dimension
        outputs = (TensorSpec("y", "FP32", (-1, 8)),)

Datatypes are spelled as in the Open Inference Protocol (BOOL, UINT8..UINT64, INT8..INT64, FP16,
BF16, FP32, FP64, BYTES). A signature feeds the protocol's model metadata and is checked before
the plugin's own validator, so a request that does not fit it never reaches a rank. A plugin
without a signature accepts any named tensor and reports none. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "BF16", "FP32", "FP64", "BYTES")


class SignatureError(ValueError):
    """A tensor that does not fit the plugin's signature; the message names the tensor and the values."""


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor: its datatype and its shape (-1 for any size along a dimension)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = False

    def __post_init__(self) -> None:
        if self.datatype not in DATATYPES:
            raise ValueError(f"TensorSpec {self.name!r}: datatype {self.datatype!r} is not one of "
                             f"{', '.join(DATATYPES)}")
        if any(not isinstance(d, int) or d < -1 for d in self.shape):
            raise ValueError(f"TensorSpec {self.name!r}: shape {self.shape} must hold ints >= 0, or -1 for any size")

    def metadata(self) -> dict[str, Any]:
        """The protocol's tensor metadata: `{"name", "datatype", "shape"}`."""
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    def check(self, datatype: str, shape: Sequence[int]) -> None:
        """Raise `SignatureError` unless a tensor of `datatype` and `shape` fits this spec."""
        if datatype != self.datatype:
            raise SignatureError(f"input {self.name!r} has datatype {datatype}, but the model expects "
                                 f"{self.datatype}; convert it before sending")
        fits = len(shape) == len(self.shape) and all(w in (-1, d) for w, d in zip(self.shape, shape))
        if not fits:
            raise SignatureError(f"input {self.name!r} has shape {list(shape)}, but the model expects "
                                 f"{list(self.shape)} (-1: any size)")


def check_inputs(specs: Sequence[TensorSpec], given: dict[str, tuple[str, Sequence[int]]]) -> None:
    """Check named inputs (name -> (datatype, shape)) against a signature; no signature accepts all."""
    if not specs:
        return
    known = {spec.name: spec for spec in specs}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise SignatureError(f"unknown input(s) {unknown}; the model's inputs are {sorted(known)}")
    missing = sorted(s.name for s in specs if not s.optional and s.name not in given)
    if missing:
        raise SignatureError(f"missing input(s) {missing}; the model's inputs are {sorted(known)}")
    for name, (datatype, shape) in given.items():
        known[name].check(datatype, shape)
