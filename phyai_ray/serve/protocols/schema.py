"""pydantic models of the HTTP bodies, for validation and for the OpenAPI document.

A plugin's `request_model` may use `EncodedTensor` for a tensor field; the body then carries the
codec's form (see `phyai_ray.serve.protocols.codec`) and the plugin receives a `torch.Tensor`:

    class MyRequest(BaseModel):
        x: EncodedTensor                     # {"__tensor__": {"dtype": "float32", "shape": [2, 8], "data": "..."}}
        scale: float = 1.0
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from phyai_ray.serve.protocols.codec import DTYPES, TENSOR_KEY

DtypeName = Literal[tuple(DTYPES)]  # type: ignore[valid-type]


class TensorFields(BaseModel):
    """The three fields of one encoded tensor."""

    model_config = ConfigDict(extra="forbid")

    dtype: DtypeName = Field(description="Element type, spelled as in torch.")
    shape: list[int] = Field(description="Dimensions; [] is a scalar, [0, 4] an empty tensor.")
    data: str = Field(description="Standard base64 (with padding) of the row-major, little-endian element bytes.")


class EncodedTensor(BaseModel):
    """A tensor in the codec's JSON form: `{"__tensor__": {"dtype", "shape", "data"}}`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, json_schema_extra={"examples": [
        {TENSOR_KEY: {"dtype": "float32", "shape": [1, 2], "data": "AACAPwAAAEA="}}]})

    tensor: TensorFields = Field(alias=TENSOR_KEY)


class StepResponse(BaseModel):
    """`result`: the output rank's return value, tensors encoded as in the request."""

    result: Any = Field(description="Plain JSON; every tensor as {\"__tensor__\": {dtype, shape, data}}.")


class ErrorDetail(BaseModel):
    type: str = Field(description="unauthorized, payload_too_large, unsupported_media_type, malformed_json, "
                                  "invalid_request, rejected, overloaded, unavailable, timeout, execution_error, "
                                  "not_found, internal, ...")
    message: str = Field(description="What failed, with the values, and what to do.")
    reason: str | None = Field(None, description="EngineUnavailableError.reason (worker_exit, timeout, exception, "
                                                 "no_healthy_replica, closed, ...), or request_timeout.")


class ErrorBody(BaseModel):
    """Every error response: `{"error": {"type": ..., "message": ...}}`."""

    error: ErrorDetail
