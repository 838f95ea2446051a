"""The layouts a Cosmos3 folder runs, checked before any rank starts, and its tensor-parallel shard.

    validate_cosmos3_parallel(transformer_config, parallel)   # pure: in the dispatcher
    shard_cosmos3(transformer, ctx)                             # on every rank, before the weights load

The design's rule for Cosmos3: its plugin declares the dense and the attention domains, and runs
tensor parallel EQUAL in both (the attention heads and the MLP units split over the same ranks),
with classifier-free guidance over `outer.cfg_size` 1 or 2. Everything else is refused, naming the
rule: pipeline stages (`outer.pp_size`), sequence parallel (`attention.cp_size`: the packed
dual-pathway attention has no sequence split), a batch split of attention (`attention.dp_size`),
mixture-of-experts splits (Cosmos3 has no MoE layers), unequal TP, and a TP size that does not
divide the query heads, the key/value heads or the MLP width.

Tensor parallel t (group "attention_tp" for the attention, "dense_tp" for the MLPs, the same ranks):
in every decoder layer the query / key / value projections of both pathways (to_q / to_k / to_v,
add_q_proj / add_k_proj / add_v_proj) keep this rank's heads (rows), the output projections (to_out,
to_add_out) its input columns, summed over the group (nn.linear's row_linear); both MLPs (`mlp`,
`mlp_moe_gen`) split gate / up by rows and down by columns. The per-head q / k norms act on head_dim
and stay whole; so do the embeddings, the modality heads and the final norms. A GQA group never
straddles ranks: t divides the key/value heads.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from phyai_ray.errors import ParallelConfigError

_ROWS = re.compile(r"layers\.\d+\.(self_attn\.(to_[qkv]|add_[qkv]_proj)|mlp(_moe_gen)?\.(gate|up)_proj)\.(weight|bias)")
_COLUMNS = re.compile(r"layers\.\d+\.(self_attn\.(to_out|to_add_out)|mlp(_moe_gen)?\.down_proj)\.weight")
RULE = ("Cosmos3 runs tensor parallel equal in the dense and attention domains (attention.tp_size == "
        "dense.tp_size, dividing the query heads, the key/value heads and the MLP width) with outer.cfg_size 1 "
        "or 2, e.g. ParallelConfig(attention=AttentionParallelConfig(tp_size=2), dense=DenseParallelConfig("
        "tp_size=2), outer=OuterParallelConfig(cfg_size=2))")


def _field(config: Mapping[str, Any] | Any, name: str) -> Any:
    return config[name] if isinstance(config, Mapping) else getattr(config, name)


def validate_cosmos3_parallel(config: Mapping[str, Any] | Any, parallel: Any) -> None:
    """Raise ParallelConfigError naming every part of `parallel` a Cosmos3 transformer with `config` cannot run."""
    heads, kv = int(_field(config, "num_attention_heads")), int(_field(config, "num_key_value_heads"))
    width = int(_field(config, "intermediate_size"))
    att, dense, moe, tp = parallel.attention, parallel.dense, parallel.moe, parallel.attention.tp_size
    rules = [
        (parallel.outer.pp_size > 1, f"outer.pp_size={parallel.outer.pp_size} (no pipeline stages)"),
        (att.cp_size > 1, f"attention.cp_size={att.cp_size} (no sequence parallel of the packed attention)"),
        (att.dp_size > 1, f"attention.dp_size={att.dp_size} (no batch split of attention)"),
        (moe.tp_size > 1 or moe.ep_size > 1, f"moe tp_size={moe.tp_size} ep_size={moe.ep_size} (no MoE layers)"),
        (dense.tp_size != tp, f"dense.tp_size={dense.tp_size} != attention.tp_size={tp} (unequal tensor parallel)"),
        (heads % tp or kv % tp, f"attention.tp_size={tp} does not divide num_attention_heads={heads} and "
                                f"num_key_value_heads={kv}"),
        (width % dense.tp_size, f"dense.tp_size={dense.tp_size} does not divide intermediate_size={width}"),
    ]
    bad = [why for broken, why in rules if broken]
    if bad:
        raise ParallelConfigError(f"Cosmos3OmniPipeline cannot run {parallel.describe()}: {'; '.join(bad)}. {RULE}")


def tp_shard_dim(name: str) -> int | None:
    """The dim along which the transformer's parameter `name` is split over tensor parallel, or None."""
    if _ROWS.fullmatch(name):
        return 0
    if _COLUMNS.fullmatch(name):
        return 1
    return None


def shard_cosmos3(transformer: Any, ctx: Any) -> Any:
    """This rank's tensor-parallel part of `transformer`, in place (see the module docstring)."""
    from phyai_ray.nn.linear import column_linear, row_linear

    tp = ctx.group_size("attention_tp")
    if tp == 1:
        return transformer
    index = ctx.group_rank("attention_tp")
    for layer in transformer.layers:
        attn = layer.self_attn
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            setattr(attn, name, column_linear(getattr(attn, name), index, tp))
        attn.to_out = row_linear(attn.to_out, index, tp, "attention_tp")
        attn.to_add_out = row_linear(attn.to_add_out, index, tp, "attention_tp")
        attn.num_attention_heads //= tp
        attn.num_key_value_heads //= tp
        for mlp in (layer.mlp, layer.mlp_moe_gen):
            if getattr(mlp, "gate_proj", None) is not None:
                mlp.gate_proj = column_linear(mlp.gate_proj, index, tp)
            mlp.up_proj = column_linear(mlp.up_proj, index, tp)
            mlp.down_proj = row_linear(mlp.down_proj, index, tp, "dense_tp")
    return transformer
