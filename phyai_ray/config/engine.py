"""What to serve: the plugin, its arguments, the device and the parallel layout of one replica."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from phyai_ray.config.base import ConfigModel
from phyai_ray.config.parallel import ParallelConfig

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class DeviceConfig(ConfigModel):
    """Device kind and parameter dtype of every rank."""

    target: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cpu, cuda, or auto (cuda where the launching process sees a GPU, else cpu).")
    params_dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32", description="dtype the plugin should build its parameters in (ctx.dtype).")

    def resolve_target(self, cuda_available: bool | None = None) -> str:
        """`cpu` or `cuda`; auto asks torch on the caller's side."""
        if self.target != "auto":
            return self.target
        if cuda_available is None:
            import torch
            cuda_available = torch.cuda.is_available()
        return "cuda" if cuda_available else "cpu"

    def torch_dtype(self) -> Any:
        import torch
        return getattr(torch, self.params_dtype)


class EngineConfig(ConfigModel):
    """Device and parallel layout of one replica."""

    device: DeviceConfig = Field(default_factory=DeviceConfig, description="Device kind and parameter dtype.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Topology of one replica.")


class EngineArgs(ConfigModel):
    """The plugin to serve and how: `EngineArgs(plugin="reference_dit", plugin_args={...}, config=...)`."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    plugin: Any = Field(description="Registered name, 'package.module:Entry', an Entry class or instance.")
    plugin_args: dict[str, Any] = Field(default_factory=dict, description="Passed to Entry.create on every rank.")
    config: EngineConfig = Field(default_factory=EngineConfig, description="Device and parallel layout.")
