"""A Hugging Face causal-LM folder: its architecture (config.json) and its tensors (safetensors), read lazily.

    ckpt = Checkpoint.open("/models/Qwen2.5-0.5B-Instruct")      # config.json, *.safetensors, tokenizer
    ckpt.arch.layers, ckpt.arch.kv_heads, ckpt.arch.rope           # the decoder's shape, checked
    w = ckpt.rows("model.layers.0.self_attn.q_proj.weight", 0, 448)   # rows 0..447 only, read from disk

Only folders are read; nothing is downloaded. `Architecture.read` refuses, before any rank starts,
every field the decoder does not implement (another architecture, a rope type, a sliding window
shorter than `max_model_len`, an activation other than SiLU), naming the field and what is
supported. Tensors are read through `safe_open(...).get_slice`, so a rank reads (and holds) only
the slice it keeps: rows of a column-parallel projection, columns of a row-parallel one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phyai_ray.nn.rotary import Rope, RopeConfigError, rope_from_config

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "MistralForCausalLM": "mistral"}
DEFAULT_MAX_LEN = 4096  # max_model_len when plugin_args leave it unset: min(max_position_embeddings, this)


class CheckpointError(ValueError):
    """A checkpoint folder this plugin cannot serve; the message names the file, field or tensor."""


@dataclass(frozen=True)
class Architecture:
    """The decoder shape of one checkpoint, from its config.json (see `read`)."""

    family: str  # llama, qwen2, qwen3, mistral
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    rope: Rope
    max_position: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tied: bool
    eos_ids: tuple[int, ...]
    bos_id: int | None
    dtype: str

    @classmethod
    def read(cls, folder: Path, max_model_len: int | None = None) -> "Architecture":
        path = folder / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path} does not exist: a checkpoint folder holds config.json and "
                                  "*.safetensors") from None
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not JSON: {exc}") from None
        arch = _architecture(raw, path)
        heads = _int(raw, "num_attention_heads", path)
        hidden = _int(raw, "hidden_size", path)
        max_position = int(raw.get("max_position_embeddings") or 4096)
        served = max_model_len or min(max_position, DEFAULT_MAX_LEN)  # the length actually served
        _check_unsupported(raw, path, min(served, max_position))
        family = ARCHITECTURES[arch]
        return cls(
            family=family, hidden=hidden, intermediate=_int(raw, "intermediate_size", path),
            layers=_int(raw, "num_hidden_layers", path), heads=heads,
            kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads), vocab=_int(raw, "vocab_size", path),
            eps=float(raw.get("rms_norm_eps", 1e-6)), rope=_position_encoding(raw, path), max_position=max_position,
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=family == "qwen3",
            tied=bool(raw.get("tie_word_embeddings", False)),
            eos_ids=_ids(_generation(folder).get("eos_token_id", raw.get("eos_token_id"))),
            bos_id=raw.get("bos_token_id"), dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"))


def _architecture(raw: dict[str, Any], path: Path) -> str:
    names = raw.get("architectures") or []
    known = [n for n in names if n in ARCHITECTURES]
    if not known:
        raise CheckpointError(f"{path}: architectures={names} is not supported; hf_causal_lm serves "
                              f"{sorted(ARCHITECTURES)}")
    return known[0]


def _generation(folder: Path) -> dict[str, Any]:
    """generation_config.json, whose eos_token_id (one id or a list) wins over config.json's; {} without it."""
    path = folder / "generation_config.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not JSON: {exc}") from None


def _int(raw: dict[str, Any], key: str, path: Path) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{path}: {key}={value!r} must be a positive integer")
    return value


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def _position_encoding(raw: dict[str, Any], path: Path) -> Rope:
    """The rotary settings (`nn.rotary.rope_from_config`); an unsupported kind names this config.json."""
    try:
        return rope_from_config(raw, path)
    except RopeConfigError as exc:
        raise CheckpointError(str(exc)) from None


def _check_unsupported(raw: dict[str, Any], path: Path, max_model_len: int) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{path}: hidden_act={act!r} is not supported; the decoder's MLP is SwiGLU (silu)")
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", "use_sliding_window" not in raw)
    if window and uses_window and window < max_model_len:
        raise CheckpointError(f"{path}: sliding_window={window} is shorter than max_model_len={max_model_len}, "
                              "and sliding-window attention is not supported; pass plugin_args max_model_len <= "
                              f"{window}")
    layer_types = set(raw.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"} and uses_window:
        raise CheckpointError(f"{path}: layer_types={sorted(layer_types)}; only full_attention is supported")
    if int(raw.get("pretraining_tp", 1)) != 1:
        raise CheckpointError(f"{path}: pretraining_tp={raw['pretraining_tp']} is not supported (only 1)")


class Checkpoint:
    """A folder's architecture and a map tensor name -> safetensors file (one file, or shards with an index)."""

    def __init__(self, folder: Path, arch: Architecture, files: dict[str, Path]) -> None:
        self.folder, self.arch, self.files = folder, arch, files

    @classmethod
    def open(cls, folder: str | Path, max_model_len: int | None = None) -> "Checkpoint":
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise CheckpointError(f"model {str(folder)!r} is not a folder; hf_causal_lm reads a local checkpoint "
                                  "folder (config.json, *.safetensors, tokenizer.json) and never downloads one")
        return cls(path, Architecture.read(path, max_model_len), _tensor_files(path))

    def names(self) -> list[str]:
        return sorted(self.files)

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every tensor the decoder reads is there with the shape config.json implies (headers only, no data)."""
        missing = [name for name in shapes if name not in self.files]
        if missing:
            self._read(missing[0], lambda part: None)  # raises, naming it
        for name, shape in shapes.items():
            found = self.shape(name)
            if found != shape:
                raise CheckpointError(f"tensor {name!r} in {self.files[name].name} has shape {list(found)}; "
                                      f"config.json implies {list(shape)}")

    def shape(self, name: str) -> tuple[int, ...]:
        return self._read(name, lambda part: tuple(part.get_shape()))

    def full(self, name: str) -> torch.Tensor:
        return self._read(name, lambda part: part[:])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, lambda part: part[start:stop])

    def columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, lambda part: part[:, start:stop])

    def _read(self, name: str, take: Any) -> Any:
        """`take(slice of name)`, the file mapped only meanwhile: pages of the file that a read touched
        count in the process's memory only while it is mapped, so a rank's peak stays near its shard."""
        from safetensors import safe_open

        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint {self.folder} "
                                  f"({len(self.files)} tensors in {sorted({f.name for f in self.files.values()})})")
        with safe_open(str(file), framework="pt") as handle:
            return take(handle.get_slice(name))


def _tensor_files(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        missing = sorted({f for f in weight_map.values() if not (folder / f).exists()})
        if missing:
            raise CheckpointError(f"{index} names shard(s) {missing[:3]} that are not in the folder")
        return {name: folder / f for name, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors file (and no model.safetensors.index.json); "
                              "save the model with safe_serialization")
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            out.update({name: file for name in handle.keys()})
    return out
