"""Plugin arguments of `hf_causal_lm`.

    plugin_args  {"model": "/models/Qwen2.5-0.5B-Instruct", "dtype": "auto", "max_model_len": 4096,
                  "kv_cache_bytes": 268435456, "enable_prefix_caching": true}

`model` is a local folder (never a hub name: nothing is downloaded). `dtype` "auto" (the default)
is the checkpoint's `torch_dtype`, except bfloat16 for a float32 checkpoint on CUDA and float32 on
CPU (Qwen3-8B loads in 16 GB of bfloat16 on a GPU, not 33 GB of float32); "engine" takes the
engine's `DeviceConfig.params_dtype`; a dtype name is used as given. `max_model_len` (the longest prompt + completion)
defaults to the checkpoint's `max_position_embeddings`, capped at DEFAULT_MAX_LEN.

The KV cache is a pool of blocks of `block_size` tokens (`phyai_ray.llm.blocks`), sized at load:
`kv_cache_bytes` when given; else on CUDA as vLLM sizes it (`cuda_kv_budget`): this engine may use
`gpu_memory_utilization` x the device's memory; what it took since it started (weights, allocator,
libraries: `torch.cuda.mem_get_info` before loading and after a profile run of one iteration of
`max_num_batched_tokens` tokens) and that iteration's peak activations are taken from it, and the
rest holds the KV cache; memory other processes hold (a colocated trainer) is never counted as free;
else (CPU) DEFAULT_CPU_KV_BYTES, or less when 64
sequences of `max_model_len` need less (a tiny model does not reserve 256 MiB), and never less than
two such sequences (so one long sequence always fits). The new tokens of one iteration (a longer
prompt is prefilled in chunks) are bounded by ONE value, the deployment's
`BatchingConfig.max_num_batched_tokens` (`token_budget`): the engine's admission counts it and
every admitted sequence's payload carries it to the ranks. `max_num_batched_tokens` here stands
for it when the deployment keeps its default, and must agree with it otherwise.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from phyai_ray.models.hf_causal_lm.checkpoint import DEFAULT_MAX_LEN, Architecture

__all__ = ["DEFAULT_CPU_KV_BYTES", "DEFAULT_MAX_LEN", "CudaMemory", "HFCausalLMConfig", "cuda_kv_budget"]

DEFAULT_CPU_KV_BYTES = 256 << 20
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class HFCausalLMConfig(BaseModel):
    """Where the checkpoint is and how to load it (the `plugin_args` of `hf_causal_lm`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="Local checkpoint folder: config.json, *.safetensors, tokenizer.")
    dtype: Literal["float32", "bfloat16", "float16", "auto", "engine"] = Field(
        "auto", description="Weights and activations; 'auto': the checkpoint's torch_dtype (bfloat16 for a float32 "
                            "checkpoint on CUDA, float32 on CPU); 'engine': the engine's DeviceConfig.params_dtype.")
    max_model_len: int | None = Field(None, ge=2, le=1 << 20,
                                      description="Longest prompt + completion; default min(max_position, 4096).")
    kv_cache_bytes: int | None = Field(None, ge=1 << 12, description="Bytes of the KV block pool (every layer, "
                                       "keys and values); default: see gpu_memory_utilization, and 256 MiB on CPU.")
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0, description="On CUDA: the fraction of the "
                                                 "device this engine may use (weights, activations, KV cache); "
                                                 "default 0.9.")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, le=1 << 20, description="Unset: the deployment's BatchingConfig.max_num_batched_tokens, the "
        "one budget of new tokens per iteration (admission and the ranks' chunks). Given, it is that value when "
        "the deployment keeps its default; a deployment that sets another is refused at start.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV blocks of a prompt prefix computed before.")

    @classmethod
    def from_args(cls, plugin_args: dict[str, Any] | None) -> "HFCausalLMConfig":
        try:
            return cls(**(plugin_args or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid plugin_args for hf_causal_lm (e.g. {{'model': '/path/to/folder'}}): "
                             f"{exc}") from None

    def token_budget(self, batching: Any = None) -> int:
        """The one budget of new tokens per iteration: `batching.max_num_batched_tokens` (the deployment's),
        or this config's value when the deployment keeps the default; before any deployment is known
        (a rank at load), this config's value, else BatchingConfig's default. Two values set apart are
        refused: max_num_batched_tokens=8 here and 256 in BatchingConfig -> ValueError naming both."""
        from phyai_ray.config.batching import BatchingConfig

        default = BatchingConfig.model_fields["max_num_batched_tokens"].default
        given = self.max_num_batched_tokens
        deployed = getattr(batching, "max_num_batched_tokens", None)
        if deployed is None or given is None:
            return deployed or given or default
        if deployed not in (given, default):
            raise ValueError(f"hf_causal_lm: plugin_args max_num_batched_tokens={given} and the deployment's "
                             f"BatchingConfig.max_num_batched_tokens={deployed} disagree; one budget of new tokens "
                             "per iteration serves admission and the ranks: set BatchingConfig.max_num_batched_"
                             "tokens (--max-num-batched-tokens) and drop it from plugin_args")
        return given

    def resolved_max_len(self, arch: Architecture) -> int:
        if self.max_model_len is not None and self.max_model_len > arch.max_position:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings={arch.max_position}")
        return self.max_model_len or min(arch.max_position, DEFAULT_MAX_LEN)

    def resolved_dtype(self, arch: Architecture, device_type: str) -> str | None:
        """The dtype name to load in; None: the engine's params_dtype (dtype="engine").

            dtype="auto", checkpoint bfloat16: "bfloat16" on CUDA, "float32" on CPU;
            checkpoint float32: "bfloat16" on CUDA, "float32" on CPU
        """
        if self.dtype == "engine":
            return None
        if self.dtype != "auto":
            return self.dtype
        if device_type != "cuda":
            return "float32"
        return "bfloat16" if arch.dtype in ("float32", "float64") else arch.dtype

    def kv_cache_budget(self, *, device: Any, per_token: int, max_len: int,
                        memory: "CudaMemory | None" = None) -> int:
        """Bytes of the KV block pool (see the module docstring); `per_token`: bytes one token takes;
        `memory`: on CUDA, what the load and the profile run measured."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        if getattr(device, "type", "cpu") == "cuda" and memory is not None:
            return cuda_kv_budget(memory, self.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION)
        return max(min(DEFAULT_CPU_KV_BYTES, 64 * max_len * per_token), 2 * max_len * per_token)


class CudaMemory(BaseModel):
    """What one rank measured on its GPU: `torch.cuda.mem_get_info` before loading (free_at_start,
    total) and after the profile run (free_now), and the profile iteration's peak activations."""

    total: int
    free_at_start: int
    free_now: int
    peak_activations: int


def cuda_kv_budget(m: CudaMemory, utilization: float) -> int:
    """vLLM's arithmetic: this engine may use utilization x total; what it took since it started
    (free_at_start - free_now: weights, allocator, libraries) and one iteration's peak activations
    come off that; the rest is the KV cache. 80 GiB at 0.9, 16 GiB taken, 2 GiB peak: 54 GiB.
    Memory other processes hold is never free: asking for more than was free at start is an error."""
    requested = int(utilization * m.total)
    if requested > m.free_at_start:
        raise ValueError(f"hf_causal_lm: gpu_memory_utilization={utilization} asks for {requested} of the device's "
                         f"{m.total} bytes, but only {m.free_at_start} were free when this engine started (other "
                         f"processes hold {m.total - m.free_at_start}); lower gpu_memory_utilization to at most "
                         f"{m.free_at_start / m.total:.3f} or free the device")
    taken = max(m.free_at_start - m.free_now, 0)
    budget = requested - taken - m.peak_activations
    if budget <= 0:
        raise ValueError(f"hf_causal_lm: gpu_memory_utilization={utilization} x {m.total} bytes leaves nothing for "
                         f"the KV cache beside the {taken} bytes this engine holds (weights and libraries) and the "
                         f"{m.peak_activations} bytes of one iteration's activations; raise gpu_memory_utilization, "
                         "lower max_num_batched_tokens, or give kv_cache_bytes")
    return budget
