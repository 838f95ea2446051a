"""The reference plugin on one rank, in this process (no Ray, no torchrun).

    python examples/reference_inline.py
    python examples/reference_inline.py --guidance 4.0 --seq 16

Builds the seeded reference transformer, runs one guided request given as plain JSON-style lists,
and prints the shape of the logits and the most likely token at every position of sample 0.
"""

from __future__ import annotations

import argparse

import torch

from phyai_ray import Engine, EngineArgs


def main(argv: list[str] | None = None) -> torch.Tensor:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guidance", type=float, default=4.0, help="classifier-free guidance scale")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8)
    opts = parser.parse_args(argv)
    tokens = torch.randint(0, 128, (opts.batch, opts.seq), generator=torch.Generator().manual_seed(0))
    request = {"tokens": tokens.tolist(), "labels": [i % 10 for i in range(opts.batch)],
               "guidance_scale": opts.guidance}
    with Engine(EngineArgs(plugin="reference_dit", plugin_args={"seed": 0})) as engine:
        logits = engine.step(request)
        print(f"mode={engine.mode} logits {tuple(logits.shape)} {logits.dtype}")
    print("argmax of sample 0:", logits[0].argmax(-1).tolist())
    return logits


if __name__ == "__main__":
    main()
