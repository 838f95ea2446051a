"""Loading a pipeline folder onto one rank: each component in its dtype, and only what the rank runs.

    dtypes = component_dtypes(plugin_args, device)     # {"transformer": bfloat16, "vae": float32, ...}
    components = load_components(folder, ctx, dtypes, encoders_here)  # transformers built empty (no weights yet)
    family.parallelize(ctx)                            # shards the empty transformers (wan_parallel.py)
    materialize(components, folder, family, ctx, dtypes)   # reads only this rank's slices from the files

Dtypes ("auto" by default, each overridable in plugin_args): on CPU everything in float32; on CUDA
the transformer(s) (`dtype`) and the text encoder (`text_encoder_dtype`) in bfloat16, the VAE and
the image encoder (`vae_dtype`) in float32, as diffusers' Wan recipe keeps its VAE. A transformer
keeps the modules its class names in `_keep_in_fp32_modules` in float32, as `from_pretrained` does.

Memory: a transformer is built from its config with empty (meta) parameters, sharded by the family
while empty, then each parameter is read from the .safetensors files as this rank's slice only
(`SafetensorsIndex.read`: plain reads of the byte ranges it needs, no mapping of the whole file),
so a tensor-parallel rank's peak holds its shard, not the whole model. Which slice is the rank's
comes from the family's own `shard_of` applied to a zero-memory index view of the full tensor. The
text encoder, the image encoder and the VAE are materialized only where they run: the encoders on
the rank that runs the encode stage (`encoders_here`: the replica's encoding rank, encode_rank.py;
every rank for a family that encodes on every rank), the VAE on the output rank (it decodes) and,
when the pipeline encodes conditioning frames with it (`PipelineSpec.vae_encodes`), where the
encoders are; elsewhere each is built empty (meta), its config readable. The guardrail
(guardrail.py) is loaded only on the output rank, on the rank's device.
"""

from __future__ import annotations

import importlib
import json
import math
import struct
from pathlib import Path
from typing import Any

import torch

TRAINABLE = ("transformer", "transformer_2")  # components a weight update may change
ENCODERS = ("text_encoder", "image_encoder")  # components only the encode stage runs
READ_CHUNK = 2 << 20  # bytes read at once when a slice is not one contiguous range
ALIGN = 4096  # a whole tensor is placed at its file offset's residue mod this (see `_placed`)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def component_dtypes(plugin_args: dict[str, Any], device: torch.device) -> dict[str, torch.dtype]:
    """The dtype of each component (see the module docstring): "auto" (or absent) picks by device."""
    cuda = torch.device(device).type != "cpu"

    def pick(key: str, auto: torch.dtype) -> torch.dtype:
        name = plugin_args.get(key) or "auto"
        return (auto if cuda else torch.float32) if name == "auto" else getattr(torch, name)

    model = pick("dtype", torch.bfloat16)
    vae = pick("vae_dtype", torch.float32)
    return {"transformer": model, "transformer_2": model, "text_encoder": pick("text_encoder_dtype", torch.bfloat16),
            "vae": vae, "image_encoder": vae}


def load_components(folder: Any, ctx: Any, dtypes: dict[str, torch.dtype],
                    encoders_here: bool = True) -> dict[str, Any]:
    """Every component of the (checked) folder, by the class its model_index.json names; the
    transformers (and encoders or a VAE this rank never runs) built empty, without weights."""
    out: dict[str, Any] = {}
    vae_here = ctx.is_output_rank or (folder.spec.vae_encodes and encoders_here)
    for name in folder.components():
        library, class_name = folder.index[name]
        path = Path(folder.path) / name
        if name in ("tokenizer", "text_tokenizer", "image_processor"):  # no weights; transformers picks the image backend
            from transformers import AutoImageProcessor, AutoTokenizer

            auto = AutoImageProcessor if name == "image_processor" else AutoTokenizer
            out[name] = auto.from_pretrained(path)
            continue
        cls = getattr(importlib.import_module(library), class_name)
        dtype = dtypes.get(name, dtypes["transformer"])
        if name == "scheduler":
            out[name] = cls.from_pretrained(path)
        elif name in TRAINABLE or (name == "vae" and not vae_here) or (name in ENCODERS and not encoders_here):
            out[name] = empty_model(cls, path, dtype)
        elif library == "transformers":
            out[name] = cls.from_pretrained(path, dtype=dtype).to(ctx.device).eval()
        else:
            out[name] = cls.from_pretrained(path, torch_dtype=dtype).to(ctx.device).eval()
    if folder.guardrail is not None and ctx.is_output_rank:  # Cosmos: the one video check of the replica
        from phyai_ray.models.diffusers_pipeline.guardrail import Guardrail

        spec, args, download = folder.guardrail
        out["safety_checker"] = Guardrail.load(spec, args, download, device=ctx.device)
    return out


def empty_model(cls: type, path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """A diffusers (or transformers) model built from its config with meta parameters (buffers real), in
    `dtype` except its `_keep_in_fp32_modules`."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        if hasattr(cls, "load_config"):  # diffusers' ConfigMixin
            model = cls.from_config(cls.load_config(path))
        else:  # a transformers PreTrainedModel (UMT5EncoderModel, Qwen2.5-VL, CLIP)
            model = cls._from_config(cls.config_class.from_pretrained(path))
    keep = getattr(cls, "_keep_in_fp32_modules", None) or []
    for name, param in model.named_parameters():
        wanted = torch.float32 if any(k in name.split(".") for k in keep) else dtype
        param.data = param.data.to(wanted)
    return model.eval()


def materialize(components: dict[str, Any], folder: Any, family: Any, ctx: Any) -> int:
    """Read this rank's slice of every empty parameter of the transformers (after `family.parallelize`)
    from the folder's files, onto the rank's device. Returns the bytes read."""
    total = 0
    for name in TRAINABLE:
        module = components.get(name)
        if module is None:
            continue
        files = SafetensorsIndex(Path(folder.path) / name)
        for key, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.device.type == "meta":
                part = files.read(key, _owned_range(family, f"{name}.{key}", files.shape(key), tensor.shape, ctx))
                _set(module, key, part.to(device=ctx.device, dtype=tensor.dtype))
                total += part.numel() * part.element_size()
        module.to(ctx.device)  # the buffers built at construction
    return total


def _owned_range(family: Any, name: str, full: tuple[int, ...], local: torch.Size, ctx: Any) -> Any:
    """(dim, start, stop) of the full tensor that this rank holds, or None for all of it: the family's
    `shard_of` applied to a view of indices along each dim (expanded: no memory)."""
    if tuple(local) == tuple(full):
        return None
    dims = [d for d in range(len(full)) if full[d] != local[d]]
    if len(dims) != 1:
        raise ValueError(f"{name}: this rank holds shape {list(local)} of {list(full)}; only a split along one "
                         "dim can be read as a slice")
    dim = dims[0]
    shape = [1] * len(full)
    shape[dim] = full[dim]
    index = torch.arange(full[dim]).view(shape).expand(full)
    part = family.shard_of(name, index, ctx)
    if tuple(part.shape) != tuple(local):
        raise ValueError(f"{name}: the family's shard_of gives shape {list(part.shape)}, but the sharded model "
                         f"holds {list(local)}; parallelize and shard_of disagree")
    start = int(part[(0,) * len(full)])
    return dim, start, start + local[dim]


def _set(module: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = key.rpartition(".")
    owner = module.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


class SafetensorsIndex:
    """Where each tensor of a folder's .safetensors files lives, read a slice at a time (plain file reads)."""

    def __init__(self, folder: Path) -> None:
        self.entries: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for file in sorted(folder.glob("*.safetensors")):
            with open(file, "rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
            for key, entry in header.items():
                if key != "__metadata__":
                    self.entries[key] = (file, 8 + size, entry)
        if not self.entries:
            raise FileNotFoundError(f"{folder}: no .safetensors weights")
        self.buffer = torch.empty(0, dtype=torch.uint8)  # one read buffer for every strided slice (no holes)

    def _scratch(self, size: int) -> torch.Tensor:
        if self.buffer.numel() < size:
            self.buffer = torch.empty(size, dtype=torch.uint8)
        return self.buffer[:size]

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.entries:
            raise KeyError(f"tensor {key!r} is not in the .safetensors files of {next(iter(self.entries.values()))[0].parent}")
        return tuple(self.entries[key][2]["shape"])

    def read(self, key: str, owned: Any = None) -> torch.Tensor:
        """Tensor `key`, or its rows start:stop along dim (`owned` = (dim, start, stop)), as its own storage."""
        file, base, entry = self.entries[key]
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])
        dim, start, stop = owned if owned is not None else (0, 0, shape[0] if shape else 1)
        outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
        rows, item = (shape[dim] if shape else 1), torch.empty((), dtype=dtype).element_size()
        begin = base + entry["data_offsets"][0]
        out = torch.empty((outer, stop - start, inner), dtype=dtype) if owned is not None else \
            _placed((1, rows, inner), dtype, begin % ALIGN)
        with open(file, "rb") as handle:
            if outer == 1:  # one contiguous range
                handle.seek(begin + start * inner * item)
                handle.readinto(memoryview(out.view(torch.uint8).numpy()).cast("B"))
            else:
                step = max(1, READ_CHUNK // (rows * inner * item))
                block = self._scratch(step * rows * inner * item).view(dtype).view(step, rows, inner)
                for first in range(0, outer, step):
                    n = min(step, outer - first)
                    handle.seek(begin + first * rows * inner * item)
                    handle.readinto(memoryview(block[:n].view(torch.uint8).numpy()).cast("B"))
                    out[first:first + n] = block[:n, start:stop]
        return out.view([*shape[:dim], stop - start, *shape[dim + 1:]] if shape else [])


class SleepState:
    """What `PipelineModel.sleep` gave back and how it comes back (C2 of the rank control lane).

    level 1   on CUDA every loaded component (transformers, text / image encoders, VAE) moves to the
              host and the CUDA cache is emptied; on CPU only caches go (little to free)
    level 2   level 1, and the transformers' parameters are dropped (empty storage, their shapes
              kept): the bytes a colocated trainer wants back. The text encoder, image encoder and
              VAE are kept on the host: a weight update names only the transformers
              (`weight_specs`), so nothing else could refill them
    wake_up   "weights": the kept components back on the rank's device; a dropped parameter gets
              its storage back when the next weight update writes it (`refill`), after which the
              outputs equal those before sleep
    """

    def __init__(self, components: dict[str, Any], device: Any) -> None:
        self.components, self.device = components, torch.device(device)
        self.level = 0
        self.dropped: dict[str, tuple[torch.Size, int]] = {}  # name: (this rank's shape, address mod ALIGN)

    def modules(self) -> dict[str, torch.nn.Module]:
        """The components with weights in memory (an empty, never-materialized VAE is left out)."""
        return {name: m for name, m in self.components.items() if isinstance(m, torch.nn.Module)
                and not any(p.device.type == "meta" for p in m.parameters())}

    def sleep(self, level: int) -> int:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (caches freed, weights to host) or 2 (weights dropped), got {level}")
        freed = self._drop() if level == 2 else 0  # wherever they are: never copied to the host first
        if self.device.type != "cpu" and self.level == 0:
            for module in self.modules().values():
                freed += _bytes(module)
                module.to("cpu")
        _release(self.device)
        self.level = max(self.level, level)
        return freed

    def _drop(self) -> int:
        freed = 0
        for name in TRAINABLE:
            module = self.components.get(name)
            for key, param in ([] if module is None else module.named_parameters()):
                if param.numel():
                    freed += param.numel() * param.element_size()
                    self.dropped[f"{name}.{key}"] = (param.shape, param.data_ptr() % ALIGN)
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        return freed

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags and self.device.type != "cpu":
            for module in self.modules().values():
                module.to(self.device)
        if "weights" in tags:
            self.level = 2 if self.dropped else 0

    def refill(self, name: str, target: torch.Tensor) -> torch.Tensor:
        """The tensor a weight update writes for `name`: `target`, or new storage for a dropped parameter."""
        if name not in self.dropped:
            return target
        shape, residue = self.dropped.pop(name)
        component, key = name.split(".", 1)
        param = self.components[component].get_parameter(key)
        if self.device.type == "cpu":  # where it was: CPU GEMMs round with the operands' alignment (`_placed`)
            param.data = _placed(tuple(shape), param.dtype, residue)
        else:
            param.data = torch.empty(shape, dtype=param.dtype, device=self.device)
        if not self.dropped:
            self.level = 0
        return param.data


def _placed(shape: tuple[int, ...], dtype: torch.dtype, residue: int) -> torch.Tensor:
    """An empty tensor whose address is `residue` mod ALIGN: where `from_pretrained`'s memory-mapped
    tensor of the same file offset sits. CPU GEMM kernels round differently with the alignment of
    their operands, so a whole tensor read here computes exactly what diffusers' own load computes."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    shift = (residue - raw.data_ptr()) % ALIGN
    if shift % torch.empty((), dtype=dtype).element_size():  # a residue this dtype cannot start at
        return torch.empty(shape, dtype=dtype)
    return raw[shift:shift + size].view(dtype).view(shape)


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _release(device: torch.device) -> None:
    """Freed storage back to the system: the CUDA cache, and glibc's free lists (malloc_trim)."""
    import ctypes
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass
