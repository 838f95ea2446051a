"""One rank of `reference_lm`: the reference model's dense blocks with causal attention and a KV cache.

Every generation runs as sequences in `Slots` (a cache row each), through `SlotDecoder`: the
iteration protocol's `admit` / `drop` / `recompute` / `iterate` drive the replica's one loop, and
`step` / `stream` run a request's prompts as sequences of their own private `Slots`:

    model.admit(1, {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                    "seed": 0, "stop_token_ids": []})
    model.iterate()   # {1: Delta([17], [-0.3], None)}: its prefill and first token
    model.iterate()   # {1: Delta([5], [-1.2], None)}: one decode step (plus any newly admitted prefill)

One iteration is one forward of every running sequence's new tokens (a prompt, a rebuilt history or
the last sampled token), projected as N real tokens and padded to [B, S] queries only inside
attention. Attention heads are split over attention_tp and MLP hidden units over dense_tp
(`phyai_ray.nn.layers`); after the reductions every rank holds the same logits, so every rank
samples the same token from the same seeded generator and no extra collective is needed to agree.
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray.llm.decoder import SlotDecoder
from phyai_ray.llm.slots import Batch, Slots
from phyai_ray.models.reference_lm.config import GenerateRequest, ReferenceLMConfig, check_topology
from phyai_ray.models.reference_lm.score import full_weights
from phyai_ray.nn.layers import Attention, DenseMLP, norm


class CausalAttention(Attention):
    """The reference attention (same shards, same tp reduction) made causal over a slot KV cache."""

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], batch: Batch) -> torch.Tensor:
        """x [N, dim], the batch's real new tokens; their k/v are written to the cache, then attended."""
        h = norm(x)
        q, k, v = ((h @ w.T).view(-1, self.local_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        keys, values = cache
        keys[batch.rows, :, batch.positions] = k
        values[batch.rows, :, batch.positions] = v
        keys, values = keys[: batch.size, :, : batch.length], values[: batch.size, :, : batch.length]
        # a finite fill (every query sees key 0, so no row is all fill): exp() of it is exactly 0
        scores = ((batch.padded(q) @ keys.transpose(-1, -2)) / self.head_dim ** 0.5).masked_fill(batch.hidden, -1e30)
        a = batch.unpadded(scores.softmax(-1) @ values)  # [N, local_heads * head_dim]
        return x + self.tp.reduce(a @ self.wo.T) + self.bo


class ReferenceLM(SlotDecoder):
    """`step({"prompts": ..., ...})` -> one `TokenOutput` per prompt (on the output rank; None elsewhere),
    and the iteration protocol (`phyai_ray.plugins.iteration`) over the sequences it admits."""

    def __init__(self, cfg: ReferenceLMConfig, ctx: Any) -> None:
        check_topology(cfg, ctx.parallel)
        self.cfg, self.ctx = cfg, ctx
        self.to = {"device": ctx.device, "dtype": torch.float32}
        self.weight_version: Any = None  # set by the engine after every weight update
        self.load_weights(list(full_weights(cfg).items()))
        self.slots = self.new_slots(rows=8, max_seq=cfg.max_seq)  # the protocol's sequences

    @torch.inference_mode()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Replace the model from FULL tensors named as `full_weights` names them (every part at once).

        Running sequences keep their caches (computed under the old weights) until `recompute`."""
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

    def new_slots(self, rows: int, max_seq: int) -> Slots:
        attention = self.blocks[0][0]
        return Slots(layers=self.cfg.layers, heads=attention.local_heads, head_dim=attention.head_dim,
                     max_seq=max_seq, vocab=self.cfg.vocab, to=self.to, rows=rows)

    def logits(self, batch: Batch, slots: Slots) -> torch.Tensor:
        """Logits [B, vocab] at each row's last new token."""
        x = self.embed["tokens"][batch.tokens] + self.embed["positions"][batch.positions]
        for i, (attention, mlp) in enumerate(self.blocks):
            x = mlp(attention.forward(x, slots.layer(i), batch))
        return norm(x[batch.last]) @ self.head["w"].T + self.head["b"]


def full_weights_names(cfg: ReferenceLMConfig) -> list[str]:
    names = ["embed.tokens", "embed.positions", "head.w", "head.b"]
    return names + [f"blocks.{i}.{k}" for i in range(cfg.layers) for k in ("wq", "wk", "wv", "wo", "bo", "w1",
                                                                             "b1", "w2", "b2")]
