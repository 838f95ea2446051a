"""One rank of `reference_lm`: the reference model's dense blocks with causal attention over a paged KV cache.

Every generation runs as sequences over one `BlockPool` through `PagedDecoder` (`phyai_ray.llm`):
the iteration protocol's `admit` / `drop` / `recompute` / `iterate` drive the replica's one loop,
and `step` / `stream` run a request's prompts as sequences of their own on the same pool:

    model.admit(1, {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                    "seed": 0, "stop_token_ids": []})
    model.iterate()   # {1: Delta([17], [-0.3], None)}: its prefill and first token
    model.iterate()   # {1: Delta([5], [-1.2], None)}: one decode step (plus any newly admitted prefill)

One iteration is one forward of every scheduled sequence's new tokens (a prompt, a rebuilt history
or the last sampled token), unpadded (`RaggedBatch`). Attention heads are split over attention_tp
and MLP hidden units over dense_tp (`phyai_ray.nn.layers`); after the reductions every rank holds
the same logits, so every rank samples the same token from the same seeded generator and no extra
collective is needed to agree.
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray.llm.blocks import BlockPool
from phyai_ray.llm.paged import PagedSequences
from phyai_ray.llm.paged_decoder import PagedDecoder
from phyai_ray.llm.ragged import RaggedBatch
from phyai_ray.models.reference_lm.config import KV_BLOCK_SIZE, GenerateRequest, ReferenceLMConfig, check_topology
from phyai_ray.models.reference_lm.score import full_weights
from phyai_ray.nn.layers import Attention, DenseMLP, norm

TOKEN_BUDGET = 2048  # most new tokens per iteration: a longer prompt is prefilled in chunks


class CausalAttention(Attention):
    """The reference attention (same shards, same tp reduction) made causal over the paged KV cache."""

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], batch: RaggedBatch) -> torch.Tensor:
        """x [N, dim], the batch's new tokens; their k/v are written to their blocks, then attended."""
        h = norm(x)
        q, k, v = ((h @ w.T).view(-1, self.local_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        batch.write(*cache, k, v)
        a = batch.attend(q, *cache).view(q.shape[0], -1)  # [N, local_heads * head_dim]
        return x + self.tp.reduce(a @ self.wo.T) + self.bo


class ReferenceLM(PagedDecoder):
    """`step({"prompts": ..., ...})` -> one `TokenOutput` per prompt (on the output rank; None elsewhere),
    and the iteration protocol (`phyai_ray.plugins.iteration`) over the sequences it admits."""

    def __init__(self, cfg: ReferenceLMConfig, ctx: Any) -> None:
        check_topology(cfg, ctx.parallel)
        self.cfg, self.ctx = cfg, ctx
        self.to = {"device": ctx.device, "dtype": torch.float32}
        self.weight_version: Any = None  # set by the engine after every weight update
        self._build(list(full_weights(cfg).items()))
        attention = self.blocks[0][0]
        pool = BlockPool(num_blocks=cfg.cache_blocks(), block_size=KV_BLOCK_SIZE, layers=cfg.layers,
                         kv_heads=attention.local_heads, head_dim=attention.head_dim, to=self.to)
        self.paged = PagedSequences(pool, max_seq=cfg.max_seq, vocab=cfg.vocab, token_budget=TOKEN_BUDGET)

    @torch.inference_mode()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Replace the model from FULL tensors named as `full_weights` names them (every part at once).

        Running sequences keep their caches (computed under the old weights) until `recompute`; no
        cached prefix is found again."""
        self._build(weights)
        self.reset_cache()

    def _build(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        named = dict(weights)
        missing = sorted(set(full_weights_names(self.cfg)) - set(named))
        if missing:
            raise ValueError(f"reference_lm load_weights: missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        base = self.cfg.blocks_config()
        self.embed = {k: named[f"embed.{k}"].to(**self.to) for k in ("tokens", "positions")}
        self.head = {k: named[f"head.{k}"].to(**self.to) for k in ("w", "b")}
        self.blocks = []
        for i in range(self.cfg.layers):
            w = {k.split(".", 2)[2]: v.float() for k, v in named.items() if k.startswith(f"blocks.{i}.")}
            self.blocks.append((CausalAttention(base, w, self.ctx, self.to), DenseMLP(base, w, self.ctx, self.to)))

    def parse(self, request: Any) -> GenerateRequest:
        return GenerateRequest.parse(request, self.cfg)

    def logits(self, batch: RaggedBatch, pool: BlockPool) -> torch.Tensor:
        """Logits [R, vocab] at the last token of each chunk that samples."""
        x = self.embed["tokens"][batch.tokens] + self.embed["positions"][batch.positions]
        for i, (attention, mlp) in enumerate(self.blocks):
            x = mlp(attention.forward(x, pool.layer(i), batch))
        return norm(x[batch.last]) @ self.head["w"].T + self.head["b"]


def full_weights_names(cfg: ReferenceLMConfig) -> list[str]:
    names = ["embed.tokens", "embed.positions", "head.w", "head.b"]
    return names + [f"blocks.{i}.{k}" for i in range(cfg.layers) for k in ("wq", "wk", "wv", "wo", "bo", "w1",
                                                                             "b1", "w2", "b2")]
