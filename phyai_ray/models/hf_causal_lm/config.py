"""Plugin arguments of `hf_causal_lm`.

    plugin_args  {"model": "/models/Qwen2.5-0.5B-Instruct", "dtype": "bfloat16", "max_model_len": 4096}

`model` is a local folder (never a hub name: nothing is downloaded). `dtype` defaults to the
engine's `DeviceConfig.params_dtype`; `max_model_len` (the longest prompt + completion) to the
checkpoint's `max_position_embeddings`, capped at DEFAULT_MAX_LEN, since every running sequence
holds a KV-cache row of that length.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from phyai_ray.models.hf_causal_lm.checkpoint import DEFAULT_MAX_LEN, Architecture

__all__ = ["DEFAULT_MAX_LEN", "HFCausalLMConfig"]


class HFCausalLMConfig(BaseModel):
    """Where the checkpoint is and how to load it (the `plugin_args` of `hf_causal_lm`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="Local checkpoint folder: config.json, *.safetensors, tokenizer.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Weights and activations; default: the engine's DeviceConfig.params_dtype.")
    max_model_len: int | None = Field(None, ge=2, le=1 << 20,
                                      description="Longest prompt + completion; default min(max_position, 4096).")

    @classmethod
    def from_args(cls, plugin_args: dict[str, Any] | None) -> "HFCausalLMConfig":
        try:
            return cls(**(plugin_args or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid plugin_args for hf_causal_lm (e.g. {{'model': '/path/to/folder'}}): "
                             f"{exc}") from None

    def resolved_max_len(self, arch: Architecture) -> int:
        if self.max_model_len is not None and self.max_model_len > arch.max_position:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings={arch.max_position}")
        return self.max_model_len or min(arch.max_position, DEFAULT_MAX_LEN)
