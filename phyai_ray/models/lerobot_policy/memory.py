"""A policy rank's memory: the dtype it serves in, and sleep that frees what it reports.

    dtype = serving_dtype(folder.config, device, plugin_args.get("dtype"))   # bf16 on CUDA by default
    with compute(device, dtype): ...            # the network's matmuls in `dtype`, norms in float32
    freed = drop_weights(net)                   # sleep(level=2): every checkpoint tensor emptied
    freed = move_weights(net, "cpu")            # sleep(level=1) on CUDA: the weights to the host

The dtype: plugin_args["dtype"] ("float32", "bfloat16", "float16") when given; otherwise float32 on
CPU, and on CUDA the checkpoint's own `dtype` field (LeRobot's pi0 / pi0.5 configs have one) or
bfloat16 when it has none (SmolVLA). The weights are stored in that dtype and the network runs
under autocast: matmuls (the attention scores' too) in that dtype, while what is written in float32
outside them stays so (Gemma's RMSNorm, the masked softmax of the "eager" attention, the time
embedding); the sample x and the Euler steps stay float32.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from typing import Any, Iterable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_dtype(given: Any) -> None:
    """Refuse a plugin_args["dtype"] that is not one of DTYPES (None: the default rule)."""
    if given is not None and given not in DTYPES:
        raise ValueError(f'lerobot_policy: plugin_args["dtype"]={given!r}; supported: {sorted(DTYPES)} '
                         "(or leave it out: bfloat16 on CUDA, float32 on CPU)")


def serving_dtype(config: dict[str, Any], device: torch.device, given: str | None = None) -> torch.dtype:
    """The dtype the rank serves in (see the module docstring)."""
    check_dtype(given)
    if given is not None:
        return DTYPES[given]
    if device.type != "cuda":
        return torch.float32
    return DTYPES.get(str(config.get("dtype", "bfloat16")), torch.bfloat16)


def compute(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The context the network runs in: autocast to `dtype` (nothing for float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def checkpoint_tensors(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers a checkpoint holds (state_dict's), by their own objects, so
    that replacing `.data` replaces the storage the network reads."""
    owned = dict(net.named_parameters())
    owned.update(net.named_buffers())
    return {name: owned[name] for name in net.state_dict()}


def drop_weights(net: torch.nn.Module) -> int:
    """Every checkpoint tensor replaced by empty storage (its dtype and device kept); the bytes freed."""
    freed = 0
    for tensor in checkpoint_tensors(net).values():
        freed += tensor.numel() * tensor.element_size()
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    release_host_memory()
    return freed


def move_weights(net: torch.nn.Module, device: Any) -> int:
    """Every parameter and buffer moved to `device`; the bytes that left another device."""
    moved = 0
    target = torch.device(device)
    for tensor in [*net.parameters(), *net.buffers()]:
        if tensor.device != target:
            moved += tensor.numel() * tensor.element_size()
            tensor.data = tensor.data.to(target)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return moved


def release_host_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim), so freed host tensors leave
    the process's RSS; nothing where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
