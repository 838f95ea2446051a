"""`ReferencePolicy`: a small action-chunk policy built from the shared dense TP layers (`phyai_ray.nn`).

    state [state_dim] -> embed -> `blocks` x DenseMLP (hidden units split over dense_tp) -> norm -> head
      -> actions [horizon, action_dim]      (tanh: every action in (-1, 1))

Weights come from a generator seeded by `seed` and are the same full tensors on every rank, each
rank keeping its dense_tp shard, so any dense_tp size gives the single-rank result. An optional
`step` count in the observation shifts the state by `sin(step / 10)` times a seeded offset, so
consecutive frames of one robot differ while staying deterministic and bounded.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from phyai_ray.nn.layers import mlp_blocks, norm
from phyai_ray.nn.weights import seeded_draw
from phyai_ray.stepwise.frames import FrameLayout, openpi_aliases, parse_frame
from phyai_ray.stepwise.policy import PolicyConfig, StepsInBatches


def _weights(cfg: PolicyConfig) -> dict[str, torch.Tensor]:
    draw = seeded_draw(cfg.seed)
    w = {"embed": draw(cfg.dim, cfg.state_dim), "offset": draw(cfg.state_dim, scale=0.5),
         "head": draw(cfg.horizon * cfg.action_dim, cfg.dim, scale=0.5 / cfg.dim ** 0.5)}
    for b in range(cfg.blocks):
        w.update({f"{b}.w1": draw(cfg.hidden, cfg.dim), f"{b}.b1": draw(cfg.hidden, scale=0.02),
                  f"{b}.w2": draw(cfg.dim, cfg.hidden), f"{b}.b2": draw(cfg.dim, scale=0.02)})
    return w


def frame_layout(cfg: PolicyConfig) -> FrameLayout:
    """Its frames: `state` (openpi's "observation/state"), `step`, `task` / `prompt`; no noise, no RTC."""
    return FrameLayout(state_dim=cfg.state_dim, action_dim=cfg.action_dim, chunk=cfg.horizon, denoised=False,
                       aliases=openpi_aliases([], "state"))


class ReferencePolicy(StepsInBatches):
    """One rank of the policy: every rank runs the same frames; dense_tp splits each MLP."""

    def __init__(self, cfg: PolicyConfig, ctx: Any) -> None:
        if cfg.hidden % ctx.group_size("dense_tp"):
            raise ValueError(f"hidden={cfg.hidden} must be divisible by dense_tp={ctx.group_size('dense_tp')}")
        self.cfg, self.ctx = cfg, ctx
        w, to = _weights(cfg), {"device": ctx.device, "dtype": torch.float32}
        self.embed, self.head, self.offset = (w[k].to(**to) for k in ("embed", "head", "offset"))
        self.blocks = mlp_blocks(w, cfg.blocks, ctx, to)
        self.layout = frame_layout(cfg)

    @torch.inference_mode()
    def step_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]] | None:
        """Several robots' frames (checked, or raw dicts: parsed here) as ONE forward (a row each); one
        {"actions": ...} per frame, in order."""
        device = self.embed.device
        frames = [parse_frame(r, self.layout) for r in requests]
        states = torch.stack([f.state for f in frames])
        shift = torch.tensor([math.sin(f.step / 10) for f in frames], dtype=torch.float32)
        states = states.to(device) + shift.to(device)[:, None] * self.offset
        x = (states @ self.embed.T).unsqueeze(1)  # [frames, 1, dim]
        for block in self.blocks:
            x = block(x)
        actions = torch.tanh(norm(x).reshape(len(requests), -1) @ self.head.T)
        actions = actions.reshape(len(requests), self.cfg.horizon, self.cfg.action_dim).cpu()
        return [{"actions": a} for a in actions.unbind(0)] if self.ctx.is_output_rank else None
