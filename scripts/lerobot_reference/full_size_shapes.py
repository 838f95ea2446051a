"""Writes the parameter shapes of LeRobot 0.4.4's FULL-size pi0 and pi0.5 (tests/data/lerobot/full_size_pi.json).

Run in the openpi reference venv (scripts/lerobot_reference/build_venv.sh, or `make lerobot-reference`):

    /tmp/lerobot-openpi-venv/bin/python scripts/lerobot_reference/full_size_shapes.py --out tests/data/lerobot

The tiny test policies are built from plugin_args["sizes"]; a served checkpoint is built from its
variant names (gemma_2b PaliGemma, gemma_300m expert, SigLIP so400m). This file lets a test check that
second path against LeRobot without 3B weights: LeRobot's model is built on the meta device (nothing
allocated) with its default config, and its state dict is written with layer indices folded,
"...layers.*.mlp.up_proj.weight": [shape, how many layers], next to the config fields the model reads.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch


def folded(shapes: dict[str, list[int]]) -> dict[str, list]:
    """{name with `.layers.<i>.` as `.layers.*.`: [shape, count]} (the same shape in every layer, checked)."""
    out: dict[str, list] = {}
    for name, shape in sorted(shapes.items()):
        key = re.sub(r"\.layers\.\d+\.", ".layers.*.", name)
        if key in out:
            if out[key][0] != shape:
                raise SystemExit(f"{name}: shape {shape} differs from another layer's {out[key][0]}")
            out[key][1] += 1
        else:
            out[key] = [shape, 1]
    return out


def full_size(kind: str) -> dict:
    import importlib

    from lerobot.configs.types import FeatureType, PolicyFeature

    configuration = importlib.import_module(f"lerobot.policies.{kind}.configuration_{kind}")
    modeling = importlib.import_module(f"lerobot.policies.{kind}.modeling_{kind}")
    config_class = configuration.PI0Config if kind == "pi0" else configuration.PI05Config
    model_class = modeling.PI0Pytorch if kind == "pi0" else modeling.PI05Pytorch
    inputs = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(14,)),
              "observation.images.base_0_rgb": PolicyFeature(type=FeatureType.VISUAL, shape=(3, 224, 224))}
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(14,))}
    cfg = config_class(input_features=inputs, output_features=outputs, device="cpu")
    with torch.device("meta"):
        model = model_class(cfg)
    fields = ("paligemma_variant", "action_expert_variant", "image_resolution", "max_state_dim",
              "max_action_dim", "chunk_size", "tokenizer_max_length", "num_inference_steps")
    return {"config": {"type": kind, **{f: getattr(cfg, f) for f in fields}},
            "shapes": folded({f"model.{k}": list(v.shape) for k, v in model.state_dict().items()})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import lerobot

    data = {"lerobot": lerobot.__version__, **{kind: full_size(kind) for kind in ("pi0", "pi05")}}
    path = args.out / "full_size_pi.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}: " + ", ".join(f"{k} {sum(c for _, c in data[k]['shapes'].values())} tensors"
                                        for k in ("pi0", "pi05")))


if __name__ == "__main__":
    main()
