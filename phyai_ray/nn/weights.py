"""Deterministic full weights of the reference transformer (`reference_dit`, `reference_lm`), and seeded draws.

Every rank generates the FULL tensors of the parts it needs with a seeded `torch.Generator`
and slices its shard; nothing is loaded or communicated. Each part (embeddings, block i, head)
has its own generator seeded from `(seed, part)`, so a pipeline stage only generates its own
blocks and the values never depend on the topology:

    part id  0           embeddings (tokens, positions, condition labels incl. the null label)
    part id  1 + i       block i (attention, then a dense or MoE MLP)
    part id  1 + layers  final head

Weights are N(0, 1/fan_in), biases N(0, 0.02^2): activations stay O(1) through the blocks.
"""

from __future__ import annotations

import torch

from phyai_ray.nn.shape import TransformerShape

Weights = dict[str, torch.Tensor]


class _Draw:
    """Draws tensors in a fixed order from one seeded generator."""

    def __init__(self, seed: int, part: int) -> None:
        self.gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + part)

    def weight(self, *shape: int) -> torch.Tensor:
        fan_in = shape[-1]
        return torch.randn(*shape, generator=self.gen, dtype=torch.float32) / fan_in ** 0.5

    def bias(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float32) * 0.02


def embedding_weights(cfg: TransformerShape) -> Weights:
    """Token [vocab, dim], position [max_seq, dim], label [classes + 1, dim] (row `classes` is null)."""
    draw = _Draw(cfg.seed, 0)
    return {"tokens": draw.weight(cfg.vocab, cfg.dim) * cfg.dim ** 0.5,
            "positions": draw.bias(cfg.max_seq, cfg.dim) * 10,
            "labels": draw.weight(cfg.classes + 1, cfg.dim) * cfg.dim ** 0.5}


def block_weights(cfg: TransformerShape, index: int) -> Weights:
    """Attention (q, k, v, o as [out, in]) plus a dense MLP or a MoE MLP for block `index`."""
    draw = _Draw(cfg.seed, 1 + index)
    d = cfg.dim
    out = {"wq": draw.weight(d, d), "wk": draw.weight(d, d), "wv": draw.weight(d, d),
           "wo": draw.weight(d, d), "bo": draw.bias(d)}
    if cfg.is_moe_block(index):
        e, h = cfg.experts, cfg.expert_width
        out.update(router=draw.weight(e, d), w1=draw.weight(e, h, d), b1=draw.bias(e, h),
                   w2=draw.weight(e, d, h), b2=draw.bias(e, d))
    else:
        out.update(w1=draw.weight(cfg.hidden, d), b1=draw.bias(cfg.hidden),
                   w2=draw.weight(d, cfg.hidden), b2=draw.bias(d))
    return out


def head_weights(cfg: TransformerShape) -> Weights:
    """Output projection [vocab, dim] and bias [vocab]."""
    draw = _Draw(cfg.seed, 1 + cfg.layers)
    return {"w": draw.weight(cfg.vocab, cfg.dim), "b": draw.bias(cfg.vocab)}


def full_weights(cfg: TransformerShape) -> Weights:
    """Every tensor of the model, named as `load_weights` expects: `embed.tokens`, `embed.positions`,
    `embed.labels`, `blocks.{i}.{wq,wk,wv,wo,bo,w1,b1,w2,b2[,router]}`, `head.w`, `head.b`.

    This is the trainer's view (one process, no sharding); every rank slices its own shards.
    """
    out = {f"embed.{k}": v for k, v in embedding_weights(cfg).items()}
    for i in range(cfg.layers):
        out.update({f"blocks.{i}.{k}": v for k, v in block_weights(cfg, i).items()})
    out.update({f"head.{k}": v for k, v in head_weights(cfg).items()})
    return out


def split_names(weights: Weights) -> dict[str, Weights]:
    """{"embed": {...}, "blocks.3": {...}, "head": {...}} from full names; unknown prefixes raise."""
    parts: dict[str, Weights] = {}
    for name, tensor in weights.items():
        head, _, key = name.rpartition(".")
        if not key or not (head in ("embed", "head") or (head.startswith("blocks.") and head[7:].isdigit())):
            raise KeyError(f"reference_dit: weight name {name!r} is not embed.*, blocks.<i>.* or head.*")
        parts.setdefault(head, {})[key] = tensor
    return parts


def shard(tensor: torch.Tensor, dim: int, index: int, count: int) -> torch.Tensor:
    """Contiguous chunk `index` of `count` equal chunks along `dim` (a copy, so the full tensor can go)."""
    size = tensor.shape[dim] // count
    return tensor.narrow(dim, index * size, size).clone()


def seeded_draw(seed: int) -> Any:
    """draw(*shape, scale=None): seeded normal tensors, scaled by 1/sqrt(fan-in) unless `scale` is given."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape: int, scale: float | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (scale if scale is not None else shape[-1] ** -0.5)
    return draw
