"""The layers room: what every model family builds from (vLLM's `model_executor/layers`).

    norm.py       rms_norm (transformers), GemmaRMSNorm (pi0 / pi0.5, adaptive), HeadShardedRMSNorm (RMSNorm
                  over heads split across a TP group), layer_norm / LayerNorm
    rotary.py     Rope + rope_from_config (default, linear, llama3 scaling), rope_cos_sin + rotate_half
                  (Llama / Qwen), gemma_rope, float32_rope (SmolVLA), rotate_pairs (Wan's 3-D)
    attention.py  the one attention entry, `attention(q, k, v, mask, backend=...)`, with backends "sdpa",
                  "eager" (float32 scores) and "diffusers"; `register_backend` adds a kernel for every model;
                  attention_lse + merge_lse for cascade attention
    sequence.py   sequence parallel (Ulysses): token ranges, the all-to-all exchanges, ulysses_attention
    linear.py     tensor-parallel linears and embeddings: Cut / shard_rows (a rank's slice), row_parallel,
                  vocab_embedding, gather_columns, column_linear / row_linear / RowParallelLinear
    shape.py      TransformerShape: sizes and seed of the reference transformer
    weights.py    its seeded full weights (every rank draws the same tensors and keeps its shard),
                  `shard`, and `seeded_draw` for small seeded models
    layers.py     the reference models' sharded blocks over the named groups: attention, dense MLP and
                  mixture-of-experts, `mlp_blocks` (residual dense blocks from a flat weight dict)

Nothing here imports a plugin (`phyai_ray.models`).
"""
