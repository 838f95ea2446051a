"""Sequence (Ulysses) and tensor parallelism for diffusers' `WanTransformer3DModel`.

    from phyai_ray.models.diffusers_pipeline.wan_parallel import shard_wan, validate_wan_parallel
    validate_wan_parallel(transformer.config, parallel)   # pure: before any rank starts
    transformer = shard_wan(transformer, ctx)              # on every rank, full weights loaded
    out = transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

`shard_wan` changes the rank's transformer in place and returns it: the same class, the same
forward signature and `config`, and the same full output on every rank (fp32: within 1e-5 of the
unsharded forward). Which layouts run, for H heads and F FFN units:

    attention.cp_size = c      Ulysses sequence parallel: H % c == 0; any sequence length
    attention.tp_size = t      heads split: H % (t * c) == 0, dense.tp_size == t, F % t == 0
    outer.cfg_size = 2         the step loop's guidance split; each branch shards as above
    refused                    attention.dp_size > 1, outer.pp_size > 1, moe tp/ep > 1, and heads
                               that do not divide (ring attention is not implemented)

E.g. 4 ranks as CP 2 x TP 2: `ParallelConfig(attention=AttentionParallelConfig(tp_size=2, cp_size=2),
dense=DenseParallelConfig(tp_size=2, dp_size=2))`; ranks 0,1 share tokens 0..S/2 and split heads.

Sequence parallel is four hooks on the unchanged diffusers forward (`_install_sequence_split`):
the forward's inputs fix the token count (and a per-token timestep, Wan 2.2 TI2V, is cut to the
rank's range), the angle table of `transformer.rope` and the first block's input are cut to the
rank's range, and `proj_out`'s output is gathered. Every block's `attn1` gets `ParallelSelfAttention`.
The layers themselves (token ranges, the Ulysses exchange, column / row linears, the head-sharded
q/k norm) are `phyai_ray.nn`'s: this module only says which of diffusers' modules each one replaces.

Image-to-video transformers (Wan 2.1 I2V, first-last-frame, the Wan 2.2 A14B experts) shard the same
way: the image rows are keys and values of `attn2` (`add_k_proj` / `add_v_proj` / `norm_added_k`, split
by head like the text's), whole on every rank of a sequence split; the first-last-frame `pos_embed` is
added to them before, in the replicated `condition_embedder`. `shard_feed_forward` serves Cosmos' FFN too.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

import torch

from phyai_ray.errors import ParallelConfigError
from phyai_ray.models.diffusers_pipeline.wan_attention import ParallelSelfAttention
from phyai_ray.nn.linear import column_linear, row_linear
from phyai_ray.nn.norm import HeadShardedRMSNorm
from phyai_ray.nn.sequence import SequenceSplit

logger = logging.getLogger(__name__)

# Parameters split over tensor parallel, by diffusers' name inside the transformer: dim 0 = rows
# (this rank's heads / hidden units), dim 1 = columns. Every other parameter is replicated.
_TP_ROWS = re.compile(r"blocks\.\d+\.(attn[12]\.(to_[qkv]|add_[kv]_proj)\.(weight|bias)"
                      r"|attn[12]\.norm_(q|k|added_k)\.weight|ffn\.net\.0\.proj\.(weight|bias))")
_TP_COLUMNS = re.compile(r"blocks\.\d+\.(attn[12]\.to_out\.0|ffn\.net\.2)\.weight")


def tp_shard_dim(name: str) -> int | None:
    """The dim along which parameter `name` (e.g. "blocks.0.attn1.to_q.weight") is split over
    tensor parallel: 0 (rows), 1 (columns), or None (every rank holds all of it). A weight update
    by diffusers' names gives rank g chunk g of tp along that dim."""
    if _TP_ROWS.fullmatch(name):
        return 0
    if _TP_COLUMNS.fullmatch(name):
        return 1
    return None


def head_split_rules(family: str, parallel: Any, heads: int, ffn: int, ffn_name: str) -> list[tuple[bool, str]]:
    """(broken, why) for the layout rules a DiT whose attention splits whole heads and whose FFN of `ffn`
    units splits over the same ranks keeps: Wan's and Cosmos-Predict2.5's. `ffn_name` names the FFN in
    the message ("ffn_dim" -> "ffn_dim=33 is not divisible ...")."""
    att, dense, moe = parallel.attention, parallel.dense, parallel.moe
    split = att.tp_size * att.cp_size
    return [
        (att.dp_size > 1, f"attention.dp_size={att.dp_size} (a batch split of attention is not implemented; "
                          "use outer.cfg_size=2 to split the guidance branches)"),
        (parallel.outer.pp_size > 1, f"outer.pp_size={parallel.outer.pp_size} (pipeline stages are not "
                                     f"implemented for {family})"),
        (moe.tp_size > 1 or moe.ep_size > 1, f"moe tp_size={moe.tp_size} ep_size={moe.ep_size} "
                                             f"({family} has no mixture-of-experts layers)"),
        (dense.tp_size != att.tp_size, f"dense.tp_size={dense.tp_size} != attention.tp_size={att.tp_size} "
                                       "(the FFN splits over the same ranks as the heads)"),
        (heads % split != 0, f"num_attention_heads={heads} is not divisible by attention.tp_size * "
                             f"attention.cp_size = {att.tp_size} * {att.cp_size} (Ulysses and tensor "
                             "parallel split whole heads; ring attention is not implemented)"),
        (ffn % dense.tp_size != 0, f"{ffn_name}={ffn} is not divisible by dense.tp_size={dense.tp_size}"),
    ]


def validate_wan_parallel(config: Mapping[str, Any] | Any, parallel: Any) -> None:
    """Raise `ParallelConfigError` naming every part of `parallel` that a Wan transformer with
    `config` (its `config.json` or `transformer.config`) cannot run. Pure: no torch, no ranks."""
    rules = head_split_rules("Wan", parallel, int(config_field(config, "num_attention_heads")),
                             int(config_field(config, "ffn_dim")), "ffn_dim")
    bad = [why for broken, why in rules if broken]
    if bad:
        raise ParallelConfigError(
            f"the Wan transformer cannot run {parallel.describe()}: {'; '.join(bad)}. Supported: "
            "attention.cp_size (Ulysses) and attention.tp_size == dense.tp_size (heads and FFN split) whose "
            "product divides the heads, with outer.cfg_size 1 or 2, e.g. ParallelConfig(attention="
            "AttentionParallelConfig(cp_size=2)) or ParallelConfig(attention=AttentionParallelConfig(tp_size=2), "
            "dense=DenseParallelConfig(tp_size=2))")


def config_field(config: Any, name: str) -> Any:
    """`name` of a config.json dict or of a model's `config` object."""
    if isinstance(config, Mapping):
        return config[name]
    return getattr(config, name)


def rank_split(transformer: torch.nn.Module, ctx: Any, shard: str) -> tuple[tuple[int, int], SequenceSplit] | None:
    """This rank's ((tensor-parallel rank, size), Ulysses split) for `shard` (shard_wan, shard_cosmos) of a
    freshly loaded transformer; None when neither axis splits (the transformer stays whole)."""
    if getattr(transformer, "_phyai_sharded", False):
        raise ValueError(f"{shard} was already applied to this transformer; shard a freshly loaded one")
    tp = (ctx.group_rank("attention_tp"), ctx.group_size("attention_tp"))
    cp = SequenceSplit("attention_cp", ctx.group_rank("attention_cp"), ctx.group_size("attention_cp"))
    return None if tp[1] == 1 and cp.count == 1 else (tp, cp)


def shard_wan(transformer: torch.nn.Module, ctx: Any) -> torch.nn.Module:
    """Turn this rank's full `WanTransformer3DModel` into its share of `ctx.parallel` (in place).

    Collective-free to build: every rank keeps its own slices of the weights it already holds.
    With tp = cp = 1 the transformer comes back untouched."""
    validate_wan_parallel(transformer.config, ctx.parallel)
    if (split := rank_split(transformer, ctx, "shard_wan")) is None:
        return transformer
    tp, cp = split
    head_dim = int(transformer.config.attention_head_dim)
    for block in transformer.blocks:
        if tp[1] > 1:
            _shard_attention(block.attn1, *tp)
            _shard_attention(block.attn2, *tp)
            shard_feed_forward(block.ffn, ctx.group_rank("dense_tp"), ctx.group_size("dense_tp"))
        block.attn1.set_processor(ParallelSelfAttention(cp, head_dim))
    if cp.count > 1:
        _install_sequence_split(transformer, cp)
    transformer._phyai_sharded = True
    logger.info("Wan transformer sharded: rank %d, heads over attention_tp %d/%d, tokens over attention_cp %d/%d",
                ctx.rank, tp[0], tp[1], cp.index, cp.count)
    return transformer


def _shard_attention(attn: Any, index: int, count: int) -> None:
    """Keep heads index*H/count .. (index+1)*H/count of one WanAttention."""
    if getattr(attn, "fused_projections", False):
        attn.unfuse_projections()
    for name in ("to_q", "to_k", "to_v", "add_k_proj", "add_v_proj"):
        if getattr(attn, name, None) is not None:
            setattr(attn, name, column_linear(getattr(attn, name), index, count))
    for name in ("norm_q", "norm_k", "norm_added_k"):
        norm = getattr(attn, name, None)
        if isinstance(norm, torch.nn.RMSNorm):
            setattr(attn, name, HeadShardedRMSNorm(norm, index, count, "attention_tp"))
        elif norm is not None and not isinstance(norm, torch.nn.Identity):
            raise ValueError(f"cannot split {type(norm).__name__} {name} over tensor parallel; "
                             "only RMSNorm across heads (Wan's qk_norm) is supported")
    attn.to_out[0] = row_linear(attn.to_out[0], index, count, "attention_tp")
    attn.heads //= count
    attn.inner_dim //= count
    attn.kv_inner_dim //= count


def shard_feed_forward(ffn: Any, index: int, count: int) -> None:
    """Hidden units index*F/count .. (index+1)*F/count of a diffusers FeedForward (GELU, Linear): the
    up projection column-parallel, the down projection row-parallel over `dense_tp` (Wan's and Cosmos' FFN)."""
    up, down = ffn.net[0], ffn.net[2]
    if not hasattr(up, "proj") or not isinstance(down, torch.nn.Linear):
        raise ValueError(f"cannot split FeedForward {ffn.net}: expected net[0].proj and net[2] linears")
    up.proj = column_linear(up.proj, index, count)
    ffn.net[2] = row_linear(down, index, count, "dense_tp")


def _install_sequence_split(transformer: Any, split: SequenceSplit) -> None:
    """The four hooks of sequence parallel (see the module docstring)."""
    patch = tuple(transformer.config.patch_size)

    def start(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        _, _, frames, height, width = x.shape
        split.start((frames // patch[0]) * (height // patch[1]) * (width // patch[2]))
        if "timestep" in kwargs and kwargs["timestep"].ndim == 2:
            kwargs = {**kwargs, "timestep": split.take(kwargs["timestep"], 1)}
        elif len(args) > 1 and args[1].ndim == 2:
            args = (args[0], split.take(args[1], 1), *args[2:])
        return args, kwargs

    def cut_angles(module: Any, args: tuple, out: tuple) -> tuple:
        return tuple(split.take(t, 1) for t in out)  # (cos, sin) per token -> this rank's tokens

    def cut_tokens(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": split.take(kwargs["hidden_states"], 1)}
        return (split.take(args[0], 1), *args[1:]), kwargs

    def gather(module: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return split.gather(out, 1)

    transformer.register_forward_pre_hook(start, with_kwargs=True)
    transformer.rope.register_forward_hook(cut_angles)
    transformer.blocks[0].register_forward_pre_hook(cut_tokens, with_kwargs=True)
    transformer.proj_out.register_forward_hook(gather)
