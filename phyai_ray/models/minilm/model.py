"""`MiniLMModel`: the per-rank sentence encoder a `MiniLMEntry` builds.

Every rank of a replica receives the same `{"sentences": [...]}`, tokenises it the same way, runs
its shard of the encoder (the all-reduces keep the ranks in lock step) and ends with the full
embeddings; only the output rank's return value reaches the caller.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from phyai_ray.models.minilm.assets import MiniLMConfig, ShardReader, load_tokenizer, model_dir
from phyai_ray.models.minilm.encoder import MiniLMEncoder
from phyai_ray.models.minilm.request import MiniLMRequest

logger = logging.getLogger(__name__)


class MiniLMModel:
    """all-MiniLM-L6-v2 on one rank: tokenizer, encoder shard, `step(request) -> [n, 384] float32 CPU`."""

    def __init__(self, plugin_args: Mapping[str, Any], ctx: Any) -> None:
        if plugin_args:
            raise ValueError(f"the minilm plugin takes no plugin_args, got {sorted(plugin_args)}; "
                             "pass plugin_args={}")
        path = model_dir()
        self.config = MiniLMConfig.load(path)
        self.device = ctx.device
        self.tokenizer = load_tokenizer(path, self.config.max_seq_length)
        self.attention_tp = (ctx.group_rank("attention_tp"), ctx.group_size("attention_tp"))
        self.dense_tp = (ctx.group_rank("dense_tp"), ctx.group_size("dense_tp"))
        reader = ShardReader(path / "model.safetensors", ctx.device, ctx.dtype)
        self.encoder = MiniLMEncoder(reader, self.config, self.attention_tp, self.dense_tp).eval()
        logger.info("minilm rank %d: heads %s, intermediate %s (attention tp %s, dense tp %s)", ctx.rank,
                    *self.shard_shapes().values(), self.attention_tp, self.dense_tp)

    def step(self, request: Mapping[str, Any]) -> torch.Tensor:
        """Embed `request["sentences"]`: float32 [n, hidden] on CPU, each row of unit L2 norm."""
        return self._embed(MiniLMRequest.parse(request).sentences)

    def step_batch(self, requests: list[Mapping[str, Any]]) -> list[torch.Tensor]:
        """Several requests as ONE forward: their sentences embedded together, split back per request."""
        parsed = [MiniLMRequest.parse(r).sentences for r in requests]
        embeddings = self._embed([s for sentences in parsed for s in sentences])
        return list(embeddings.split([len(sentences) for sentences in parsed]))

    def _embed(self, sentences: list[str]) -> torch.Tensor:
        batch = self.tokenize(sentences)
        with torch.inference_mode():
            embeddings = self.encoder(**batch)
        return embeddings.to(device="cpu", dtype=torch.float32)

    def tokenize(self, sentences: list[str]) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask and token_type_ids [n, longest], padded on the right."""
        encodings = self.tokenizer.encode_batch(sentences)

        def stack(field: str) -> torch.Tensor:
            return torch.tensor([getattr(e, field) for e in encodings], dtype=torch.long, device=self.device)

        return {"input_ids": stack("ids"), "attention_mask": stack("attention_mask"),
                "token_type_ids": stack("type_ids")}

    def shard_shapes(self) -> dict[str, int]:
        """Heads and intermediate units this rank holds (12 and 1536 at TP=1, 6 and 768 at TP=2)."""
        first = self.encoder.layers[0]
        return {"heads": first.attention.local_heads, "intermediate": first.mlp.up_weight.shape[0]}
