"""Which slice of every checkpoint tensor one rank keeps: the tensor-parallel plan, pure index math.

    attention over attention_tp (t ranks), rank r:
        q_proj  rows of query heads [r*H/t, (r+1)*H/t)            (column parallel; its bias alike)
        k/v     rows of key/value heads [r*KV/t, (r+1)*KV/t) when t divides KV; when KV < t (t % KV == 0)
                each rank keeps the ONE kv head its query heads read: head r*KV//t (replicated t/KV times)
        o_proj  columns of its query heads                         (row parallel: all_reduce, bias once)
    MLP over dense_tp (t ranks): gate/up rows [r*I/t, (r+1)*I/t), down_proj columns of the same
    embedding and lm_head over dense_tp, by vocabulary rows: ceil(V/t) rows each (the last rank's
        padded with zeros), so a rank holds 1/t of both; lookups sum over the group (a row outside
        the shard contributes 0) and the logits are gathered, so every rank samples from the full row
    norms (input, post-attention, final, Qwen3's q/k norms): whole on every rank

    Qwen2-0.5B (H=14, KV=2, I=4864, V=151936) at t=2: q rows 0..447 | 448..895, k/v head 0 | 1,
    gate/up rows 0..2431 | 2432..4863, vocab rows 0..75967 | 75968..151935.

Why shard the vocabulary: in small models the embedding and lm_head are a large share of the
weights (Qwen2-0.5B: 272M of 494M with the head tied); replicated, TP=2 would save only a quarter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phyai_ray.models.hf_causal_lm.checkpoint import Architecture
from phyai_ray.llm.topology import decoder_rules, refuse
from phyai_ray.nn.linear import Cut


@dataclass(frozen=True)
class ShardPlan:
    """The tensors of one rank: its tp index and count for attention and dense, and the slices they imply."""

    arch: Architecture
    attn_rank: int = 0
    attn_size: int = 1
    dense_rank: int = 0
    dense_size: int = 1

    @classmethod
    def for_rank(cls, arch: Architecture, ctx: Any) -> "ShardPlan":
        return cls(arch, ctx.group_rank("attention_tp"), ctx.group_size("attention_tp"),
                   ctx.group_rank("dense_tp"), ctx.group_size("dense_tp"))

    @property
    def local_heads(self) -> int:
        return self.arch.heads // self.attn_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.arch.kv_heads // self.attn_size)

    @property
    def vocab_rows(self) -> int:
        return -(-self.arch.vocab // self.dense_size)

    @property
    def vocab_start(self) -> int:
        return self.dense_rank * self.vocab_rows

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model reads, by its transformers name, with its full shape."""
        a = self.arch
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        shapes = {"model.embed_tokens.weight": (a.vocab, a.hidden), "model.norm.weight": (a.hidden,)}
        if not a.tied:
            shapes["lm_head.weight"] = (a.vocab, a.hidden)
        for i in range(a.layers):
            p = f"model.layers.{i}."
            layer = {"input_layernorm.weight": (a.hidden,), "post_attention_layernorm.weight": (a.hidden,),
                     "self_attn.q_proj.weight": (q, a.hidden), "self_attn.k_proj.weight": (kv, a.hidden),
                     "self_attn.v_proj.weight": (kv, a.hidden), "self_attn.o_proj.weight": (a.hidden, q),
                     "mlp.gate_proj.weight": (a.intermediate, a.hidden),
                     "mlp.up_proj.weight": (a.intermediate, a.hidden),
                     "mlp.down_proj.weight": (a.hidden, a.intermediate)}
            if a.qkv_bias:
                layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)}
            if a.o_bias:
                layer["self_attn.o_proj.bias"] = (a.hidden,)
            if a.mlp_bias:
                layer |= {"mlp.gate_proj.bias": (a.intermediate,), "mlp.up_proj.bias": (a.intermediate,),
                          "mlp.down_proj.bias": (a.hidden,)}
            if a.qk_norm:
                layer |= {"self_attn.q_norm.weight": (a.head_dim,), "self_attn.k_norm.weight": (a.head_dim,)}
            shapes.update({p + k: v for k, v in layer.items()})
        return shapes

    def cut(self, name: str) -> Cut:
        """This rank's slice of tensor `name` (see the module docstring)."""
        a, kind, hd = self.arch, ".".join(name.split(".")[-2:]), self.arch.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Cut(0, self.vocab_start, min(self.vocab_start + self.vocab_rows, a.vocab), self.vocab_rows)
        if kind.startswith("q_proj."):
            return Cut(0, self.attn_rank * self.local_heads * hd, (self.attn_rank + 1) * self.local_heads * hd)
        if kind.startswith(("k_proj.", "v_proj.")):
            first = self.attn_rank * a.kv_heads // self.attn_size if a.kv_heads < self.attn_size \
                else self.attn_rank * self.local_kv_heads
            return Cut(0, first * hd, (first + self.local_kv_heads) * hd)
        if kind == "o_proj.weight":
            return Cut(1, self.attn_rank * self.local_heads * hd, (self.attn_rank + 1) * self.local_heads * hd)
        share = a.intermediate // self.dense_size
        if kind in ("gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias"):
            return Cut(0, self.dense_rank * share, (self.dense_rank + 1) * share)
        if kind == "down_proj.weight":
            return Cut(1, self.dense_rank * share, (self.dense_rank + 1) * share)
        return Cut()  # norms, and biases of row-parallel projections (added once, after the reduction)


def check_topology(arch: Architecture, parallel: Any) -> None:
    """Refuse a topology the plan cannot split, with the numbers; before any rank starts."""
    ta, td = parallel.attention.tp_size, parallel.dense.tp_size
    refuse("hf_causal_lm", parallel, [
        (arch.heads % ta == 0, f"num_attention_heads={arch.heads} % attention.tp={ta} != 0"),
        (arch.kv_heads % ta == 0 or ta % arch.kv_heads == 0,
         f"num_key_value_heads={arch.kv_heads} and attention.tp={ta}: one must divide the other"),
        (arch.intermediate % td == 0, f"intermediate_size={arch.intermediate} % dense.tp={td} != 0"),
        *decoder_rules(parallel)], " on this checkpoint")
