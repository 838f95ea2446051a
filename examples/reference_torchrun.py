"""The reference plugin on torchrun ranks: every process is one rank and calls `step` itself.

    torchrun --nproc_per_node=2 examples/reference_torchrun.py --layout tp2
    torchrun --nproc_per_node=8 examples/reference_torchrun.py --layout pp2_cfg2_tp2 --out /tmp/logits

Layouts are the names in `phyai_ray.models.reference_dit.layouts` (their rank count must match
--nproc_per_node); several may be given comma-separated. Every rank sends the same requests in the
same order; the output rank prints a summary and, with --out DIR, saves `DIR/<layout>.pt` (the
list of logits, torch.save). Closing an external engine tears down the process's torch.distributed world, so the
engines of several layouts stay open side by side (sharing that world) and close together.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch

from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig
from phyai_ray.models.reference_dit.layouts import LAYOUTS, sample_requests


def run_layout(engine: Engine) -> list[torch.Tensor] | None:
    """Serve the sample requests; the output rank returns the logits, the other ranks None."""
    outs = [engine.step(request, timeout=60) for request in sample_requests()]
    return None if outs[0] is None else outs


def open_engine(name: str, plugin_args: dict) -> Engine:
    config = EngineConfig(device=DeviceConfig(target="cpu"), parallel=LAYOUTS[name])
    args = EngineArgs(plugin="reference_dit", plugin_args=plugin_args, config=config)
    return Engine(args, DeploymentConfig.external())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="tp2", help="comma-separated names from LAYOUTS")
    parser.add_argument("--out", default=None, help="folder where the output rank saves <layout>.pt")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    with contextlib.ExitStack() as engines:
        for name in opts.layout.split(","):
            outs = run_layout(engines.enter_context(open_engine(name, {"seed": opts.seed})))
            if outs is not None:
                print(f"rank {os.environ.get('RANK')}: {name} -> logits {tuple(outs[0].shape)}, "
                      f"mean {outs[0].mean().item():+.5f}", flush=True)
                if opts.out:
                    os.makedirs(opts.out, exist_ok=True)
                    torch.save(outs, os.path.join(opts.out, f"{name}.pt"))


if __name__ == "__main__":
    main()
