"""The layers room: building blocks several plugins share (`reference_dit`, `reference_lm`, the policies).

    shape.py    TransformerShape: sizes and seed of the reference transformer
    weights.py  its seeded full weights (every rank draws the same tensors and keeps its shard),
                `shard`, and `seeded_draw` for small seeded models
    layers.py   attention, dense MLP and mixture-of-experts shards over the named groups, `norm`,
                and `mlp_blocks` (residual dense blocks from a flat weight dict)

Nothing here imports a plugin (`phyai_ray.models`).
"""
