"""Named topologies the reference plugin is checked on, and a seeded batch of sample requests.

The examples and tests share these: `--layout pp2_tp2` on an example means
`LAYOUTS["pp2_tp2"]`, and every layout must reproduce the single-rank logits.

    name            ranks  what splits
    tp2             2      dense + attention tensor parallel
    cp2             2      attention context parallel (sequence)
    adp2_ep2        2      attention batch split, MoE experts split
    ep2 / moe_tp2   2      MoE experts / each expert's hidden units
    dp2             2      dense and MoE batch split (explicit dp)
    pp2 / cfg2      2      pipeline stages / guidance branches
    tp2_cfg2        4      TP inside each guidance branch
    pp2_tp2         4      TP inside each pipeline stage
    mixed4          4      attention tp2 x cp2, dense tp2 x dp2, MoE ep2 x tp2
    pp2_cfg2_tp2    8      all outer axes with TP inside
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray.config.parallel import (AttentionParallelConfig as A, DenseParallelConfig as D,
                                       MoeParallelConfig as M, OuterParallelConfig as O, ParallelConfig)

_TP2 = {"dense": D(tp_size=2), "attention": A(tp_size=2)}

LAYOUTS: dict[str, ParallelConfig] = {
    "single": ParallelConfig(),
    "tp2": ParallelConfig(**_TP2),
    "cp2": ParallelConfig(attention=A(cp_size=2)),
    "adp2_ep2": ParallelConfig(attention=A(dp_size=2), moe=M(ep_size=2)),
    "ep2": ParallelConfig(moe=M(ep_size=2)),
    "moe_tp2": ParallelConfig(moe=M(tp_size=2)),
    "dp2": ParallelConfig(dense=D(dp_size=2), moe=M(dp_size=2)),
    "pp2": ParallelConfig(outer=O(pp_size=2)),
    "cfg2": ParallelConfig(outer=O(cfg_size=2)),
    "tp2_cfg2": ParallelConfig(outer=O(cfg_size=2), **_TP2),
    "pp2_tp2": ParallelConfig(outer=O(pp_size=2), **_TP2),
    "mixed4": ParallelConfig(dense=D(tp_size=2, dp_size=2), attention=A(tp_size=2, cp_size=2),
                             moe=M(ep_size=2, tp_size=2)),
    "pp2_cfg2_tp2": ParallelConfig(outer=O(pp_size=2, cfg_size=2), **_TP2),
}


def sample_requests(vocab: int = 128, classes: int = 10, batch: int = 4, seq: int = 8,
                    seed: int = 1) -> list[dict[str, Any]]:
    """Three requests: guided (tensor tokens), guided with scale 0 (JSON lists), unguided."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, classes, (batch,), generator=gen)
    return [{"tokens": tokens, "labels": labels, "guidance_scale": 4.0},
            {"tokens": tokens.flip(1).tolist(), "labels": labels.tolist(), "guidance_scale": 0.0},
            {"tokens": tokens.roll(1, 0)}]
