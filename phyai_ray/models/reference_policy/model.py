"""`ReferencePolicy`: a small action-chunk policy built from the reference model's dense TP layers.

    state [state_dim] -> embed -> `blocks` x DenseMLP (hidden units split over dense_tp) -> norm -> head
      -> actions [horizon, action_dim]      (tanh: every action in (-1, 1))

Weights come from a generator seeded by `seed` and are the same full tensors on every rank, each
rank keeping its dense_tp shard, so any dense_tp size gives the single-rank result. An optional
`step` count in the observation shifts the state by `sin(step / 10)` times a seeded offset, so
consecutive frames of one robot differ while staying deterministic and bounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from phyai_ray.models.reference_dit.layers import DenseMLP, norm


@dataclass(frozen=True)
class PolicyConfig:
    """plugin_args of the policy: sizes and the seed."""

    state_dim: int = 8
    action_dim: int = 7
    horizon: int = 10
    dim: int = 64
    hidden: int = 128
    blocks: int = 2
    seed: int = 0

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "PolicyConfig":
        return policy_args(cls, args, "reference_policy")


def policy_args(cls: type, args: dict[str, Any] | None, plugin: str, flags: tuple[str, ...] = ()) -> Any:
    """`cls(**args)` of a policy's plugin_args: known names only, positive ints (seed: any int), `flags` bools."""
    args = dict(args or {})
    unknown = sorted(set(args) - set(cls.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown {plugin} plugin_args {unknown}; known: {sorted(cls.__dataclass_fields__)}")
    cfg = cls(**args)
    bad = {k: v for k, v in vars(cfg).items() if (not isinstance(v, bool) if k in flags else
                                                   isinstance(v, bool) or not isinstance(v, int) or (v < 1 and k != "seed"))}
    if bad:
        raise ValueError(f"{plugin} plugin_args must be positive ints (seed: any int"
                         f"{'; ' + ', '.join(flags) + ': bool' if flags else ''}), got {bad}")
    return cfg


def seeded_draw(seed: int) -> Any:
    """draw(*shape, scale=None): seeded normal tensors, scaled by 1/sqrt(fan-in) unless `scale` is given."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape: int, scale: float | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (scale if scale is not None else shape[-1] ** -0.5)
    return draw


def mlp_blocks(w: dict[str, torch.Tensor], blocks: int, ctx: Any, to: dict) -> list[DenseMLP]:
    """The policy's residual MLP blocks ("{b}.w1" ... "{b}.b2"), each rank keeping its dense_tp shard."""
    return [DenseMLP(None, {k: w[f"{b}.{k}"] for k in ("w1", "b1", "w2", "b2")}, ctx, to) for b in range(blocks)]


def _weights(cfg: PolicyConfig) -> dict[str, torch.Tensor]:
    draw = seeded_draw(cfg.seed)
    w = {"embed": draw(cfg.dim, cfg.state_dim), "offset": draw(cfg.state_dim, scale=0.5),
         "head": draw(cfg.horizon * cfg.action_dim, cfg.dim, scale=0.5 / cfg.dim ** 0.5)}
    for b in range(cfg.blocks):
        w.update({f"{b}.w1": draw(cfg.hidden, cfg.dim), f"{b}.b1": draw(cfg.hidden, scale=0.02),
                  f"{b}.w2": draw(cfg.dim, cfg.hidden), f"{b}.b2": draw(cfg.dim, scale=0.02)})
    return w


class StepsInBatches:
    """`step(frame)` as a batch of one (`step_batch`): {"actions": ...} on the output rank, None elsewhere."""

    @torch.inference_mode()
    def step(self, request: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        out = self.step_batch([request])
        return None if out is None else out[0]


class ReferencePolicy(StepsInBatches):
    """One rank of the policy: every rank runs the same frames; dense_tp splits each MLP."""

    def __init__(self, cfg: PolicyConfig, ctx: Any) -> None:
        if cfg.hidden % ctx.group_size("dense_tp"):
            raise ValueError(f"hidden={cfg.hidden} must be divisible by dense_tp={ctx.group_size('dense_tp')}")
        self.cfg, self.ctx = cfg, ctx
        w, to = _weights(cfg), {"device": ctx.device, "dtype": torch.float32}
        self.embed, self.head, self.offset = (w[k].to(**to) for k in ("embed", "head", "offset"))
        self.blocks = mlp_blocks(w, cfg.blocks, ctx, to)

    @torch.inference_mode()
    def step_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]] | None:
        """Several robots' frames as ONE forward (a row each); one {"actions": ...} per frame, in order."""
        device = self.embed.device
        states = torch.stack([torch.as_tensor(r["state"], dtype=torch.float32).reshape(-1) for r in requests])
        shift = torch.tensor([math.sin(int(r.get("step", 0)) / 10) for r in requests], dtype=torch.float32)
        states = states.to(device) + shift.to(device)[:, None] * self.offset
        x = (states @ self.embed.T).unsqueeze(1)  # [frames, 1, dim]
        for block in self.blocks:
            x = block(x)
        actions = torch.tanh(norm(x).reshape(len(requests), -1) @ self.head.T)
        actions = actions.reshape(len(requests), self.cfg.horizon, self.cfg.action_dim).cpu()
        return [{"actions": a} for a in actions.unbind(0)] if self.ctx.is_output_rank else None
