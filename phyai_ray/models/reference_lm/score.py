"""The trainer's side of `reference_lm`: its full weights and log-probs of a completion, in plain torch.

    weights = full_weights(ReferenceLMConfig(seed=0))            # {name: tensor}, as load_weights takes
    lp = score(weights, prompt=[1, 2, 3], completion=[7, 9])     # [log p(7 | 1 2 3), log p(9 | 1 2 3 7)]

`score` runs the whole sequence at once (no KV cache, no tensor parallelism) with the same math as
the engine's ranks (`phyai_ray.nn`'s norm and attention entry), so a rollout's
`TokenOutput.log_probs` must equal it; it is differentiable in the weights (a policy-gradient loss
can be built on it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phyai_ray.nn import weights as W
from phyai_ray.nn.attention import attention
from phyai_ray.nn.layers import norm
from phyai_ray.models.reference_lm.config import ReferenceLMConfig

Weights = dict[str, torch.Tensor]


def full_weights(cfg: ReferenceLMConfig) -> Weights:
    """Every tensor of the model by name: `embed.{tokens,positions}`, `blocks.{i}.*`, `head.{w,b}`."""
    base = cfg.blocks_config()
    embed = W.embedding_weights(base)
    out = {"embed.tokens": embed["tokens"], "embed.positions": embed["positions"]}
    for i in range(cfg.layers):
        out.update({f"blocks.{i}.{k}": v for k, v in W.block_weights(base, i).items()})
    out.update({f"head.{k}": v for k, v in W.head_weights(base).items()})
    return out


def logits(weights: Weights, cfg: ReferenceLMConfig, tokens: list[int]) -> torch.Tensor:
    """Next-token logits [len(tokens), vocab] of one sequence."""
    ids = torch.tensor(tokens)
    x = weights["embed.tokens"][ids] + weights["embed.positions"][: len(tokens)]
    s, hd = len(tokens), cfg.dim // cfg.heads
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.layers):
        w = {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"blocks.{i}.")}
        h = norm(x)
        q, k, v = ((h @ w[n].T).view(s, cfg.heads, hd).transpose(0, 1) for n in ("wq", "wk", "wv"))
        a = attention(q[None], k[None], v[None], causal)[0]  # [heads, s, hd]
        x = x + a.transpose(0, 1).reshape(s, cfg.dim) @ w["wo"].T + w["bo"]
        x = x + F.gelu(norm(x) @ w["w1"].T + w["b1"]) @ w["w2"].T + w["b2"]
    return norm(x) @ weights["head.w"].T + weights["head.b"]


def score(weights: Weights, prompt: list[int], completion: list[int],
          cfg: ReferenceLMConfig | None = None) -> torch.Tensor:
    """log p(completion[i] | prompt + completion[:i]) for every i, shape [len(completion)]."""
    cfg = cfg or ReferenceLMConfig(vocab=weights["head.w"].shape[0], dim=weights["head.w"].shape[1],
                                   max_seq=weights["embed.positions"].shape[0],
                                   layers=1 + max(int(k.split(".")[1]) for k in weights if k.startswith("blocks.")))
    out = logits(weights, cfg, list(prompt) + list(completion))
    logp = out[len(prompt) - 1: len(prompt) - 1 + len(completion)].log_softmax(-1)
    return logp.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
