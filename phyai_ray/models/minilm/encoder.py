"""The MiniLM-L6 BERT encoder in plain torch, with Megatron-style tensor parallelism.

One layer on tp rank r of T (hidden D=384, H=12 heads of d=32, intermediate I=1536):

    attention  query/key/value rows [r*D/T, (r+1)*D/T)  -> this rank's H/T heads       (column parallel)
               output.dense columns of the same slice    -> partial sum, all_reduce over "attention_tp"
    MLP        intermediate rows [r*I/T, (r+1)*I/T)      -> GELU on this rank's slice   (column parallel)
               output.dense columns of the same slice    -> partial sum, all_reduce over "dense_tp"

With T=2: rank 0 holds heads 0-5 and intermediate units 0-767, rank 1 heads 6-11 and 768-1535.
The heads' outputs are concatenated in head order, so the output projection's input columns split
the same way. Row-parallel biases are added once, after the reduction; embeddings, LayerNorms,
mean pooling and L2 normalisation are replicated, so every rank ends with the same embeddings.
At T=1 the groups are the identity and this is exactly BERT. The LayerNorm, the attention entry
(backend "sdpa") and the row-parallel reductions are `phyai_ray.nn`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phyai_ray.models.minilm.assets import MiniLMConfig, ShardReader
from phyai_ray.nn.attention import attention
from phyai_ray.nn.linear import row_parallel
from phyai_ray.nn.norm import LayerNorm


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _checkpoint_ln(reader: ShardReader, prefix: str, eps: float) -> LayerNorm:
    """nn's LayerNorm with the checkpoint's `{prefix}.weight`, `{prefix}.bias` and eps."""
    return LayerNorm(reader.full(f"{prefix}.weight"), reader.full(f"{prefix}.bias"), eps)


class Embeddings(nn.Module):
    """word + absolute position + token type embeddings, then LayerNorm (replicated on every rank)."""

    def __init__(self, reader: ShardReader, cfg: MiniLMConfig) -> None:
        super().__init__()
        self.word = _param(reader.full("embeddings.word_embeddings.weight"))
        self.position = _param(reader.full("embeddings.position_embeddings.weight"))
        self.token_type = _param(reader.full("embeddings.token_type_embeddings.weight"))
        self.norm = _checkpoint_ln(reader, "embeddings.LayerNorm", cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = F.embedding(input_ids, self.word) + F.embedding(positions, self.position)[None]
        return self.norm(x + F.embedding(token_type_ids, self.token_type))


class ParallelSelfAttention(nn.Module):
    """Self-attention over this rank's H/T heads; the output projection is reduced over `attention_tp`."""

    def __init__(self, reader: ShardReader, prefix: str, cfg: MiniLMConfig, rank: int, size: int) -> None:
        super().__init__()
        self.local_heads, self.head_dim = cfg.heads // size, cfg.head_dim
        names = [f"{prefix}.self.{n}" for n in ("query", "key", "value")]
        # q, k, v shards stacked along the output dim: rows [q_local | k_local | v_local]
        self.qkv_weight = _param(torch.cat([reader.shard(f"{n}.weight", 0, rank, size) for n in names]))
        self.qkv_bias = _param(torch.cat([reader.shard(f"{n}.bias", 0, rank, size) for n in names]))
        self.out_weight = _param(reader.shard(f"{prefix}.output.dense.weight", 1, rank, size))
        self.out_bias = _param(reader.full(f"{prefix}.output.dense.bias"))
        self.norm = _checkpoint_ln(reader, f"{prefix}.output.LayerNorm", cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x: [B, L, D]; keep: [B, 1, 1, L] bool, True on real tokens (padding keys are masked out)."""
        batch, length, _ = x.shape
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.view(batch, length, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        heads = attention(q, k, v, keep, backend="sdpa")  # [B, H/T, L, d]
        joined = heads.transpose(1, 2).reshape(batch, length, -1)
        return self.norm(row_parallel(joined, self.out_weight, self.out_bias, "attention_tp") + x)


class ParallelMLP(nn.Module):
    """GELU MLP over this rank's slice of the intermediate units; reduced over `dense_tp`."""

    def __init__(self, reader: ShardReader, prefix: str, cfg: MiniLMConfig, rank: int, size: int) -> None:
        super().__init__()
        self.up_weight = _param(reader.shard(f"{prefix}.intermediate.dense.weight", 0, rank, size))
        self.up_bias = _param(reader.shard(f"{prefix}.intermediate.dense.bias", 0, rank, size))
        self.down_weight = _param(reader.shard(f"{prefix}.output.dense.weight", 1, rank, size))
        self.down_bias = _param(reader.full(f"{prefix}.output.dense.bias"))
        self.norm = _checkpoint_ln(reader, f"{prefix}.output.LayerNorm", cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(F.linear(x, self.up_weight, self.up_bias))
        return self.norm(row_parallel(hidden, self.down_weight, self.down_bias, "dense_tp") + x)


class EncoderLayer(nn.Module):
    """One post-LayerNorm BERT layer: attention block, then MLP block."""

    def __init__(self, reader: ShardReader, index: int, cfg: MiniLMConfig,
                 attention_tp: tuple[int, int], dense_tp: tuple[int, int]) -> None:
        super().__init__()
        prefix = f"encoder.layer.{index}"
        self.attention = ParallelSelfAttention(reader, f"{prefix}.attention", cfg, *attention_tp)
        self.mlp = ParallelMLP(reader, prefix, cfg, *dense_tp)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attention(x, keep))


class MiniLMEncoder(nn.Module):
    """Token ids -> L2-normalised mean-pooled sentence embeddings [B, D].

    `attention_tp` and `dense_tp` are (group rank, group size) of this rank in those groups.
    """

    def __init__(self, reader: ShardReader, cfg: MiniLMConfig,
                 attention_tp: tuple[int, int] = (0, 1), dense_tp: tuple[int, int] = (0, 1)) -> None:
        super().__init__()
        self.embeddings = Embeddings(reader, cfg)
        self.layers = nn.ModuleList(EncoderLayer(reader, i, cfg, attention_tp, dense_tp)
                                    for i in range(cfg.layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)
        keep = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keep)
        return F.normalize(mean_pool(x, attention_mask), p=2, dim=1)


def mean_pool(tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average of the token vectors where attention_mask is 1: [B, L, D], [B, L] -> [B, D]."""
    mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
    return (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
