"""Sequence (Ulysses) and tensor parallelism for diffusers' `CosmosTransformer3DModel` (Cosmos-Predict2.5).

    from phyai_ray.models.diffusers_pipeline.cosmos_parallel import shard_cosmos, validate_cosmos_parallel
    validate_cosmos_parallel(transformer.config, parallel)   # pure: before any rank starts
    transformer = shard_cosmos(transformer, ctx)              # on every rank, full weights loaded

`shard_cosmos` changes the rank's transformer in place and returns it: the same class, forward
signature and `config`, and the full output on every rank (fp32: within 1e-5 of the unsharded
forward). The layouts are Wan's (wan_parallel.py), for H heads and F = hidden x mlp_ratio FFN units:

    attention.cp_size = c      Ulysses: H % c == 0; any sequence length
    attention.tp_size = t      heads split: H % (t * c) == 0, dense.tp_size == t, F % t == 0
    outer.cfg_size = 2         the step loop's guidance split; each branch shards as above
    refused                    attention.dp_size > 1, outer.pp_size > 1, moe tp/ep > 1, heads that do not
                               divide, and tensor parallel of the image-context cross-attention
                               (img_context_dim_in, Cosmos-Transfer's; Predict2.5 has none)

What differs from Wan is where the per-token tensors live. A Cosmos block takes, besides its tokens,
the timestep's modulation per token ([B, tokens, C] when the timestep is per latent frame, as the
pipeline gives it), the rotary table [tokens, head_dim] and the learnable position embedding
[B, tokens, C]. Sequence parallel is hooks on the unchanged diffusers forward (`_install_sequence_split`):
the forward's input fixes the token count; the rotary table and the position embedding are cut where
they are made; every block and `norm_out` get their per-token arguments cut to the rank's range;
`proj_out`'s output is gathered before diffusers un-patchifies it. Every block's `attn1` gets
`CosmosSelfAttention`. The q / k norms of Cosmos are per head (RMSNorm over head_dim), so under tensor
parallel they stay whole on every rank: only the projections split (phyai_ray.nn.linear).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

import torch

from phyai_ray.errors import ParallelConfigError
from phyai_ray.models.diffusers_pipeline.wan_parallel import config_field, head_split_rules, rank_split, shard_feed_forward
from phyai_ray.nn.linear import column_linear, row_linear
from phyai_ray.nn.rotary import rotate_half
from phyai_ray.nn.sequence import SequenceSplit, ulysses_attention

logger = logging.getLogger(__name__)

# Parameters split over tensor parallel, by diffusers' name inside the transformer (dim 0 rows, dim 1 columns).
_TP_ROWS = re.compile(r"transformer_blocks\.\d+\.(attn[12]\.to_[qkv]|ff\.net\.0\.proj)\.(weight|bias)")
_TP_COLUMNS = re.compile(r"transformer_blocks\.\d+\.(attn[12]\.to_out\.0|ff\.net\.2)\.weight")


def cosmos_tp_shard_dim(name: str) -> int | None:
    """The dim along which parameter `name` ("transformer_blocks.0.attn1.to_q.weight") is split over
    tensor parallel: 0 (rows), 1 (columns) or None (every rank holds all of it)."""
    if _TP_ROWS.fullmatch(name):
        return 0
    if _TP_COLUMNS.fullmatch(name):
        return 1
    return None


def validate_cosmos_parallel(config: Mapping[str, Any] | Any, parallel: Any) -> None:
    """Raise `ParallelConfigError` naming every part of `parallel` that a Cosmos transformer with `config`
    (its config.json or `transformer.config`) cannot run. Pure: no torch, no ranks."""
    heads = int(config_field(config, "num_attention_heads"))
    ffn = int(heads * int(config_field(config, "attention_head_dim")) * float(config_field(config, "mlp_ratio")))
    image, tp = _optional(config, "img_context_dim_in"), parallel.attention.tp_size
    rules = head_split_rules("Cosmos", parallel, heads, ffn, "the FFN's hidden units") + [
        (bool(image) and tp > 1, f"img_context_dim_in={image} with attention.tp_size={tp} "
                                 "(the image-context cross-attention is not split over tensor parallel)"),
    ]
    bad = [why for broken, why in rules if broken]
    if bad:
        raise ParallelConfigError(
            f"the Cosmos transformer cannot run {parallel.describe()}: {'; '.join(bad)}. Supported: "
            "attention.cp_size (Ulysses) and attention.tp_size == dense.tp_size whose product divides the heads, "
            "with outer.cfg_size 1 or 2, e.g. ParallelConfig(attention=AttentionParallelConfig(cp_size=2))")


def _optional(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def shard_cosmos(transformer: torch.nn.Module, ctx: Any) -> torch.nn.Module:
    """Turn this rank's full `CosmosTransformer3DModel` into its share of `ctx.parallel` (in place).

    Collective-free to build: every rank keeps its slices of the weights it holds. With tp = cp = 1
    the transformer comes back untouched."""
    validate_cosmos_parallel(transformer.config, ctx.parallel)
    if (split := rank_split(transformer, ctx, "shard_cosmos")) is None:
        return transformer
    tp, cp = split
    for block in transformer.transformer_blocks:
        if tp[1] > 1:
            _shard_attention(block.attn1, *tp)
            _shard_attention(block.attn2, *tp)
            shard_feed_forward(block.ff, ctx.group_rank("dense_tp"), ctx.group_size("dense_tp"))
        if cp.count > 1:
            block.attn1.set_processor(CosmosSelfAttention(cp))
    if cp.count > 1:
        _install_sequence_split(transformer, cp)
    transformer._phyai_sharded = True
    logger.info("Cosmos transformer sharded: rank %d, heads over attention_tp %d/%d, tokens over attention_cp "
                "%d/%d", ctx.rank, tp[0], tp[1], cp.index, cp.count)
    return transformer


def _shard_attention(attn: Any, index: int, count: int) -> None:
    """Keep heads index*H/count .. (index+1)*H/count of one diffusers `Attention` with per-head q/k norms."""
    for name in ("to_q", "to_k", "to_v"):
        setattr(attn, name, column_linear(getattr(attn, name), index, count))
    attn.to_out[0] = row_linear(attn.to_out[0], index, count, "attention_tp")
    attn.heads //= count
    attn.inner_dim //= count
    attn.inner_kv_dim //= count


class CosmosSelfAttention:
    """Attention processor of a Cosmos block's `attn1` on one rank of a sequence split: what diffusers'
    `CosmosAttnProcessor2_0` computes for self-attention, in the same order, on the rank's tokens:
    q / k / v, the per-head norms, the rotary table already cut to the rank's tokens (nn.rotary's
    rotate_half is Cosmos' half-split form, in float32 as diffusers' apply_rotary_emb), attention over
    every token (nn.sequence.ulysses_attention, diffusers' dispatcher), to_out."""

    def __init__(self, split: SequenceSplit) -> None:
        self.split = split

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: tuple | None = None) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("CosmosSelfAttention serves self-attention without a mask (a Cosmos block's attn1); "
                             "it was given encoder_hidden_states or attention_mask")
        q, k, v = (proj(hidden_states).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)  # [b, s, h, d]: over head_dim, as diffusers on [b, h, s, d]
        if image_rotary_emb is not None:
            cos, sin = (t[None, :, None, :] for t in image_rotary_emb)
            q, k = (rotate_half(t.float(), cos, sin).to(t.dtype) for t in (q, k))
        out = ulysses_attention(q, k, v, self.split, backend="diffusers").flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def _install_sequence_split(transformer: Any, split: SequenceSplit) -> None:
    """The hooks of sequence parallel (see the module docstring)."""
    patch = tuple(transformer.config.patch_size)

    def start(module: Any, args: tuple, kwargs: dict) -> None:
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        _, _, frames, height, width = x.shape
        split.start((frames // patch[0]) * (height // patch[1]) * (width // patch[2]))

    def per_token(positions: tuple[int, ...]) -> Any:
        def cut(module: Any, args: tuple) -> tuple:
            total = split.ranges[-1][1]
            return tuple(split.take(a, 1) if i in positions and isinstance(a, torch.Tensor) and a.ndim == 3
                         and a.shape[1] == total else a for i, a in enumerate(args))
        return cut

    def gather(module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return split.gather(out, 1)

    transformer.register_forward_pre_hook(start, with_kwargs=True)
    transformer.rope.register_forward_hook(lambda m, a, out: tuple(split.take(t, 0) for t in out))
    if transformer.learnable_pos_embed is not None:
        transformer.learnable_pos_embed.register_forward_hook(lambda m, a, out: split.take(out, 1))
    for block in transformer.transformer_blocks:  # (hidden_states, context, embedded_timestep, temb, ...)
        block.register_forward_pre_hook(per_token((0, 2, 3)))
    transformer.norm_out.register_forward_pre_hook(per_token((1, 2)))  # (hidden_states, embedded_timestep, temb)
    transformer.proj_out.register_forward_hook(gather)


def cosmos_shard_of(name: str, full: torch.Tensor, ctx: Any) -> torch.Tensor:
    """This rank's part of the full tensor `name` ("transformer.transformer_blocks.0.attn1.to_q.weight") of a
    weight update: its chunk along `cosmos_tp_shard_dim` over tensor parallel, else all of it."""
    dim = cosmos_tp_shard_dim(name.split(".", 1)[1])
    group = "dense_tp" if ".ff." in name else "attention_tp"
    if dim is None or ctx.group_size(group) == 1:
        return full
    return full.chunk(ctx.group_size(group), dim)[ctx.group_rank(group)]
