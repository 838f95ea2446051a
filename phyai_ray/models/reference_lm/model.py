"""One rank of `reference_lm`: the reference model's dense blocks with causal attention and a KV cache.

Prompts of different lengths are left-padded to one width: the pad columns are masked out as keys,
and each token's position counts from its own prompt's first token. Every step appends one
column for every prompt (finished prompts feed a dummy token that nothing reads). Attention heads
are split over attention_tp and MLP hidden units over dense_tp (`reference_dit.layers`); after the
reductions every rank holds the same logits, so every rank samples the same token from the same
seeded generator and no extra collective is needed to agree on it.
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray.models.reference_dit import weights as W
from phyai_ray.models.reference_dit.layers import Attention, DenseMLP, norm
from phyai_ray.models.reference_lm.config import GenerateRequest, ReferenceLMConfig, check_topology
from phyai_ray.models.reference_lm.score import full_weights
from phyai_ray.outputs import TokenOutput


class CausalAttention(Attention):
    """The reference attention (same shards, same tp reduction) made causal, with a KV cache."""

    def forward(self, x: torch.Tensor, cache: dict, key_mask: torch.Tensor) -> torch.Tensor:
        h = norm(x)
        q, k, v = (self._heads(h @ w.T) for w in (self.wq, self.wk, self.wv))
        if cache:
            k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
        cache["k"], cache["v"] = k, v
        s, t = q.shape[2], k.shape[2]
        causal = torch.ones(s, t, dtype=torch.bool).tril(t - s)
        mask = causal[None, None] & key_mask[:, None, None, :t]
        # a finite fill: a pad query (masked everywhere) stays finite, and exp() of it is exactly 0 elsewhere
        scores = ((q @ k.transpose(-1, -2)) / self.head_dim ** 0.5).masked_fill(~mask, -1e30)
        a = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
        return x + self.tp.reduce(a @ self.wo.T) + self.bo


class ReferenceLM:
    """`step({"prompts": ..., ...})` -> one `TokenOutput` per prompt (on the output rank; None elsewhere)."""

    def __init__(self, cfg: ReferenceLMConfig, ctx: Any) -> None:
        check_topology(cfg, ctx.parallel)
        self.cfg, self.ctx = cfg, ctx
        self.to = {"device": ctx.device, "dtype": torch.float32}
        self.weight_version: Any = None  # set by the engine after every weight update
        self.load_weights(list(full_weights(cfg).items()))

    @torch.inference_mode()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Replace the model from FULL tensors named as `full_weights` names them (every part at once)."""
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

    def reset_cache(self) -> None:
        """The KV cache lives for one request; nothing outlives it."""

    @torch.inference_mode()
    def step(self, request: Any) -> list[TokenOutput] | None:
        req = GenerateRequest.parse(request, self.cfg)
        outputs = self.generate(req)
        return outputs if self.ctx.is_output_rank else None

    @torch.inference_mode()
    def stream(self, request: Any, emit: Any) -> list[TokenOutput]:
        """Like step, emitting {"index": t, "token_ids": [...], "log_probs": [...]} per token step
        (None for prompts already finished); stops on every rank when `emit` returns False."""
        req = GenerateRequest.parse(request, self.cfg)
        return self.generate(req, on_token=emit)

    def generate(self, req: GenerateRequest, on_token: Any = None) -> list[TokenOutput]:
        """Greedy or seeded sampling for every prompt; `on_token(step, tokens)` may return False to stop."""
        width = max(len(p) for p in req.prompts)
        pads = torch.tensor([width - len(p) for p in req.prompts])
        tokens = torch.tensor([[0] * (width - len(p)) + p for p in req.prompts], device=self.ctx.device)
        key_mask = torch.arange(width)[None, :] >= pads[:, None]
        caches = [{} for _ in self.blocks]
        logits = self._forward(tokens, torch.arange(width)[None, :] - pads[:, None], key_mask, caches)[:, -1]
        gen = torch.Generator().manual_seed(req.seed)
        outs = [([], [], None) for _ in req.prompts]
        alive = [True] * len(req.prompts)
        for t in range(req.max_tokens):
            logits = logits.float().cpu()
            logp = logits.log_softmax(-1)
            chosen = _sample(logits, req, gen)
            was_alive = list(alive)
            for b in range(len(outs)):
                if alive[b]:
                    self._record(outs, alive, b, int(chosen[b]), float(logp[b, chosen[b]]), req, t)
            if on_token is not None and on_token(_chunk(t, chosen, logp, was_alive)) is False:
                break
            if not any(alive):
                break
            key_mask = torch.cat([key_mask, torch.ones(len(outs), 1, dtype=torch.bool)], 1)
            positions = (width + t - pads)[:, None]
            logits = self._forward(chosen[:, None].to(self.ctx.device), positions, key_mask, caches)[:, -1]
        stopped = on_token is not None and any(alive)
        return [TokenOutput(ids, lps, stop_reason=reason or ("aborted" if stopped else "length"),
                            weight_version=self.weight_version) for ids, lps, reason in outs]

    @staticmethod
    def _record(outs: list, alive: list, b: int, token: int, logp: float, req: GenerateRequest, t: int) -> None:
        ids, lps, _ = outs[b]
        ids.append(token)
        lps.append(logp)
        if token in req.stop_token_ids:
            outs[b], alive[b] = (ids, lps, "completed"), False
        elif len(ids) >= req.max_tokens:
            outs[b], alive[b] = (ids, lps, "length"), False

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
                 caches: list[dict]) -> torch.Tensor:
        x = self.embed["tokens"][tokens] + self.embed["positions"][positions.clamp(min=0).to(self.ctx.device)]
        for (attention, mlp), cache in zip(self.blocks, caches):
            x = mlp(attention.forward(x, cache, key_mask.to(self.ctx.device)))
        return norm(x) @ self.head["w"].T + self.head["b"]


def _chunk(t: int, chosen: torch.Tensor, logp: torch.Tensor, alive: list[bool]) -> dict[str, Any]:
    ids = [int(c) if a else None for c, a in zip(chosen, alive)]
    lps = [float(logp[b, c]) if a else None for b, (c, a) in enumerate(zip(chosen, alive))]
    return {"index": t, "token_ids": ids, "log_probs": lps}


def full_weights_names(cfg: ReferenceLMConfig) -> list[str]:
    names = ["embed.tokens", "embed.positions", "head.w", "head.b"]
    return names + [f"blocks.{i}.{k}" for i in range(cfg.layers) for k in ("wq", "wk", "wv", "wo", "bo", "w1",
                                                                             "b1", "w2", "b2")]


def _sample(logits: torch.Tensor, req: GenerateRequest, gen: torch.Generator) -> torch.Tensor:
    """Greedy at temperature 0; else top-k / top-p filtered sampling from `gen` (identical on every rank)."""
    if req.temperature == 0.0:
        return logits.argmax(-1)
    scaled = logits / req.temperature
    if req.top_k:
        kth = scaled.topk(min(req.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if req.top_p < 1.0:
        ordered, index = scaled.sort(-1, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= req.top_p  # keep the smallest prefix reaching top_p
        scaled = scaled.scatter(-1, index, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(scaled.softmax(-1), 1, generator=gen).squeeze(1)
