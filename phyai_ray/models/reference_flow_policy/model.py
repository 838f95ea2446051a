"""`ReferenceFlowPolicy`: a flow-matching action-chunk policy in the shape of pi0's action expert.

    observation (state [, step]) -> c = embed(state)                      once, when a frame is admitted
    x_0 ~ N(0, I) [horizon, action_dim]  (torch.Generator seeded by the frame's noise_seed, or its noise)
    for j in 0 .. num_steps-1:  t = j / num_steps
        v = head(norm(blocks(x_in(x_t) + c + time_embed(t))))           the velocity network (dense TP)
        x_{t+dt} = x_t + dt * v                                          one Euler step = ONE iteration
    actions = x_1

One denoising step per iteration of the iteration protocol: every running frame of every robot
takes its next step in ONE forward, a new frame joins at the next iteration and leaves when its
last step ends (the running set and the step counting are phyai_ray/stepwise/sequence.py's). A
frame's rows never mix with another's, so batched == alone (to float rounding).

Real-time chunking (frames with `prev_actions`; phyai_ray/stepwise/rtc.py): at every step the clean
estimate x1_hat = x_t + (1 - t) v is pulled toward the previous chunk with RTC's exponentially
decaying weights and v is taken from the pulled estimate; the frozen prefix is then re-imposed on
the straight path (1 - t) x_0 + t prev, so the first d returned actions are prev_actions[:d]
exactly. Frames with and without RTC share a batch.

Weights come from a generator seeded by `seed`, the same full tensors on every rank, each rank
keeping its dense_tp shard, so any dense_tp size gives the single-rank result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from phyai_ray.models.reference_flow_policy.config import RTC, FlowPolicyConfig, frame_layout
from phyai_ray.nn.layers import mlp_blocks, norm
from phyai_ray.nn.weights import seeded_draw
from phyai_ray.plugins.iteration import Delta
from phyai_ray.stepwise.frames import RobotFrame, parse_frame
from phyai_ray.stepwise.policy import StepsInBatches
from phyai_ray.stepwise.rtc import Guidance
from phyai_ray.stepwise.sequence import Running, Sequence

TIME_FREQS = 16


def _weights(cfg: FlowPolicyConfig) -> dict[str, torch.Tensor]:
    draw = seeded_draw(cfg.seed)
    chunk = cfg.horizon * cfg.action_dim
    w = {"embed": draw(cfg.dim, cfg.state_dim), "offset": draw(cfg.state_dim, scale=0.5),
         "time": draw(cfg.dim, 2 * TIME_FREQS), "x_in": draw(cfg.dim, chunk),
         "head": draw(chunk, cfg.dim, scale=0.5 / cfg.dim ** 0.5)}
    for b in range(cfg.blocks):
        w.update({f"{b}.w1": draw(cfg.hidden, cfg.dim), f"{b}.b1": draw(cfg.hidden, scale=0.02),
                  f"{b}.w2": draw(cfg.dim, cfg.hidden), f"{b}.b2": draw(cfg.dim, scale=0.02)})
    return w


@dataclass(eq=False, kw_only=True)
class Denoising(Sequence):
    """One frame on its way (`value`: the sample x_t after `index` steps): its noise, conditioning, RTC."""

    frame: RobotFrame
    x0: torch.Tensor  # [H, A] the initial noise
    c: torch.Tensor  # [dim] the observation's embedding
    guide: Guidance | None = None


class ReferenceFlowPolicy(StepsInBatches):
    """One rank of the flow policy: the iteration protocol (admit, drop, recompute, iterate), and
    `step` / `step_batch` running every Euler step of whole frames at once."""

    def __init__(self, cfg: FlowPolicyConfig, ctx: Any) -> None:
        if cfg.hidden % ctx.group_size("dense_tp"):
            raise ValueError(f"hidden={cfg.hidden} must be divisible by dense_tp={ctx.group_size('dense_tp')}")
        self.cfg, self.ctx, self.layout = cfg, ctx, frame_layout(cfg)
        self.to = {"device": ctx.device, "dtype": torch.float32}
        w = _weights(cfg)
        self.embed, self.offset, self.time, self.x_in, self.head = (
            w[k].to(**self.to) for k in ("embed", "offset", "time", "x_in", "head"))
        self.blocks = mlp_blocks(w, cfg.blocks, ctx, self.to)
        self.freqs = torch.exp(torch.arange(TIME_FREQS, dtype=torch.float32) * (-math.log(1000.0) / TIME_FREQS))
        self.running: Running[Denoising] = Running()

    # -- the iteration protocol -----------------------------------------------------------------
    @torch.inference_mode()
    def admit(self, ident: int, payload: RobotFrame) -> None:
        self.running.admit(ident, self._start(payload))

    def drop(self, ident: int) -> None:
        self.running.drop(ident)

    @torch.inference_mode()
    def recompute(self, ident: int) -> None:
        """Denoise the frame again from its noise (the weights changed under it)."""
        if ident in self.running:
            self.running.admit(ident, self._start(self.running[ident].frame))

    @torch.inference_mode()
    def iterate(self) -> dict[int, Delta]:
        """ONE Euler step of every running frame; a frame whose last step this was ends with its actions."""
        return self.running.iterate(self._advance, lambda seq: {"actions": seq.value.cpu()})

    # -- whole frames -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step_batch(self, requests: list[Any]) -> list[dict[str, torch.Tensor]] | None:
        """Every Euler step of several frames, batched as whole requests (the same math as per step)."""
        frames = [self._start(parse_frame(r, self.layout)) for r in requests]  # defaults as per step
        for _ in range(self.cfg.num_steps):
            self._advance(frames)
        return [{"actions": f.value.cpu()} for f in frames] if self.ctx.is_output_rank else None

    # -- the math -------------------------------------------------------------------------------
    def _start(self, frame: RobotFrame) -> Denoising:
        cfg, device = self.cfg, self.to["device"]
        if frame.noise is not None:
            x0 = frame.noise.to(**self.to)
        else:
            gen = torch.Generator(device="cpu").manual_seed(frame.noise_seed)
            x0 = torch.randn(cfg.horizon, cfg.action_dim, generator=gen).to(**self.to)
        state = frame.state.to(device) + math.sin(frame.step / 10) * self.offset
        guide = None if frame.prev_actions is None else Guidance.build(
            RTC, frame.prev_actions.to(device), frame.inference_delay, frame.execution_horizon, cfg.horizon,
            cfg.action_dim, device)
        return Denoising(value=x0.clone(), steps=cfg.num_steps, frame=frame, x0=x0, c=state @ self.embed.T,
                         guide=guide)

    def _velocity(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """v(x_t, t | obs) for a batch: x [B, H, A], t [B], c [B, dim] -> [B, H, A]."""
        angles = t[:, None] * self.freqs.to(t.device)[None, :] * 1000.0
        temb = torch.cat([angles.sin(), angles.cos()], dim=-1) @ self.time.T
        h = (x.reshape(x.shape[0], -1) @ self.x_in.T + c + temb).unsqueeze(1)  # [B, 1, dim]
        for block in self.blocks:
            h = block(h)
        return (norm(h).squeeze(1) @ self.head.T).reshape(x.shape)

    def _advance(self, frames: list[Denoising]) -> None:
        """One Euler step of every frame in `frames` (one forward), RTC guidance per frame."""
        n = self.cfg.num_steps
        x = torch.stack([f.value for f in frames])
        t = torch.tensor([f.index / n for f in frames], **self.to)
        v = self._velocity(x, t, torch.stack([f.c for f in frames]))
        for row, frame in enumerate(frames):
            vi, xi = v[row], x[row]
            if frame.guide is not None:  # RTC: pull the clean estimate toward the previous chunk
                vi = frame.guide.velocity(xi, vi, 1 - frame.index / n)
            frame.took(xi + vi / n)
            if frame.guide is not None:  # the frozen prefix: exactly prev_actions[:d] at t = 1
                frame.guide.freeze(frame.value, frame.x0, frame.index / n)
