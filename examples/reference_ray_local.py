"""The reference plugin as a Ray replica on this machine: one rank actor per rank, gloo on CPU.

    python examples/reference_ray_local.py --layout pp2_tp2
    python examples/reference_ray_local.py --layout tp2 --replicas 2

Starts a local Ray instance when none is running. The layout names are those of
`phyai_ray.models.reference_dit.layouts`; the result is compared with the single-rank (inline)
result of the same requests, which is what every layout must reproduce.
"""

from __future__ import annotations

import argparse

import torch

from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig
from phyai_ray.models.reference_dit.layouts import LAYOUTS, sample_requests


def serve(layout: str, deployment: DeploymentConfig | None = None, seed: int = 0) -> list[torch.Tensor]:
    """Logits of the sample requests on `layout` (single-rank layouts run inline)."""
    config = EngineConfig(device=DeviceConfig(target="cpu"), parallel=LAYOUTS[layout])
    args = EngineArgs(plugin="reference_dit", plugin_args={"seed": seed}, config=config)
    with Engine(args, deployment) as engine:
        futures = [engine.submit(request) for request in sample_requests()]
        return [f.result(timeout=120) for f in futures]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="tp2", choices=sorted(LAYOUTS))
    parser.add_argument("--replicas", type=int, default=1)
    opts = parser.parse_args(argv)
    expected = serve("single")
    got = serve(opts.layout, DeploymentConfig.local(replica_count=opts.replicas))
    errors = [relative_error(g, e) for g, e in zip(got, expected)]
    print(f"{opts.layout} on Ray: logits {tuple(got[0].shape)}, relative error vs one rank "
          f"{max(errors):.2e} (limit 1e-5)")
    return max(errors)


if __name__ == "__main__":
    main()
