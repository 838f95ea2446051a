"""`ReferenceFlowPolicy`: a flow-matching action-chunk policy in the shape of pi0's action expert.

    observation (state [, step]) -> c = embed(state)                      once, when a frame is admitted
    x_0 ~ N(0, I) [horizon, action_dim]  (torch.Generator seeded by the frame's noise_seed)
    for j in 0 .. num_steps-1:  t = j / num_steps
        v = head(norm(blocks(x_in(x_t) + c + time_embed(t))))           the velocity network (dense TP)
        x_{t+dt} = x_t + dt * v                                          one Euler step = ONE iteration
    actions = x_1

One denoising step per iteration of the iteration protocol: every running frame of every robot
takes its next step in ONE forward, a new frame joins at the next iteration and leaves when its
last step ends. A frame's rows never mix with another's, so batched == alone (to float rounding).

Real-time chunking (frames with `prev_actions`): at every step the clean estimate
x1_hat = x_t + (1 - t) v is pulled toward the previous chunk with RTC's weights (1 on the frozen
prefix, decaying after it, 0 past the guided span) and v is taken from the pulled estimate; the
frozen prefix is then re-imposed on the straight path (1 - t) x_0 + t prev, so the first d
returned actions are prev_actions[:d] exactly. Frames with and without RTC share a batch.

Weights come from a generator seeded by `seed`, the same full tensors on every rank, each rank
keeping its dense_tp shard, so any dense_tp size gives the single-rank result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from phyai_ray.models.reference_flow_policy.config import FlowPolicyConfig, Frame, rtc_weights
from phyai_ray.nn.layers import mlp_blocks, norm
from phyai_ray.nn.weights import seeded_draw
from phyai_ray.plugins.iteration import Delta
from phyai_ray.policy.frames import StepsInBatches

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


@dataclass
class Denoising:
    """One frame on its way: its noise, current sample, conditioning and RTC guidance."""

    x0: torch.Tensor  # [H, A] the initial noise
    x: torch.Tensor  # [H, A] the sample at step j
    c: torch.Tensor  # [dim] the observation's embedding
    j: int = 0  # steps taken
    guide: torch.Tensor | None = None  # [H] RTC weights (None: no RTC)
    target: torch.Tensor | None = None  # [H, A] prev_actions, zero-padded
    delay: int = 0


class ReferenceFlowPolicy(StepsInBatches):
    """One rank of the flow policy: the iteration protocol (admit, drop, recompute, iterate), and
    `step` / `step_batch` running every Euler step of whole frames at once."""

    def __init__(self, cfg: FlowPolicyConfig, ctx: Any) -> None:
        if cfg.hidden % ctx.group_size("dense_tp"):
            raise ValueError(f"hidden={cfg.hidden} must be divisible by dense_tp={ctx.group_size('dense_tp')}")
        self.cfg, self.ctx = cfg, ctx
        self.to = {"device": ctx.device, "dtype": torch.float32}
        w = _weights(cfg)
        self.embed, self.offset, self.time, self.x_in, self.head = (
            w[k].to(**self.to) for k in ("embed", "offset", "time", "x_in", "head"))
        self.blocks = mlp_blocks(w, cfg.blocks, ctx, self.to)
        self.freqs = torch.exp(torch.arange(TIME_FREQS, dtype=torch.float32) * (-math.log(1000.0) / TIME_FREQS))
        self.running: dict[int, tuple[Denoising, dict[str, Any]]] = {}

    # -- the iteration protocol -----------------------------------------------------------------
    @torch.inference_mode()
    def admit(self, ident: int, payload: dict[str, Any]) -> None:
        self.running[ident] = (self._start(payload), payload)

    def drop(self, ident: int) -> None:
        self.running.pop(ident, None)

    @torch.inference_mode()
    def recompute(self, ident: int) -> None:
        """Denoise the frame again from its noise (the weights changed under it)."""
        if ident in self.running:
            payload = self.running[ident][1]
            self.running[ident] = (self._start(payload), payload)

    @torch.inference_mode()
    def iterate(self) -> dict[int, Delta]:
        """ONE Euler step of every running frame; a frame whose last step this was ends with its actions."""
        if not self.running:
            return {}
        idents = list(self.running)
        frames = [self.running[i][0] for i in idents]
        self._advance(frames)
        out: dict[int, Delta] = {}
        for ident, frame in zip(idents, frames):
            if frame.j == self.cfg.num_steps:
                del self.running[ident]
                out[ident] = Delta(stop_reason="completed", value={"actions": frame.x.cpu()})
        return out

    # -- whole frames -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]] | None:
        """Every Euler step of several frames, batched as whole requests (the same math as per step)."""
        frames = [self._start(Frame.parse(r, self.cfg).to_payload()) for r in requests]  # defaults as per step
        for _ in range(self.cfg.num_steps):
            self._advance(frames)
        return [{"actions": f.x.cpu()} for f in frames] if self.ctx.is_output_rank else None

    # -- the math -------------------------------------------------------------------------------
    def _start(self, payload: dict[str, Any]) -> Denoising:
        cfg, device = self.cfg, self.to["device"]
        gen = torch.Generator(device="cpu").manual_seed(int(payload["noise_seed"]))
        x0 = torch.randn(cfg.horizon, cfg.action_dim, generator=gen).to(**self.to)
        state = torch.as_tensor(payload["state"], dtype=torch.float32).reshape(-1).to(device)
        state = state + math.sin(int(payload.get("step", 0)) / 10) * self.offset
        frame = Denoising(x0=x0, x=x0.clone(), c=state @ self.embed.T)
        prev = payload.get("prev_actions")
        if prev is not None:
            k = prev.shape[0]
            frame.guide = rtc_weights(cfg.horizon, payload["inference_delay"], k,
                                      payload.get("execution_horizon")).to(**self.to)
            frame.target = torch.zeros(cfg.horizon, cfg.action_dim, **self.to)
            frame.target[:k] = torch.as_tensor(prev, dtype=torch.float32).to(device)
            frame.delay = int(payload["inference_delay"])
        return frame

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
        x = torch.stack([f.x for f in frames])
        t = torch.tensor([f.j / n for f in frames], **self.to)
        v = self._velocity(x, t, torch.stack([f.c for f in frames]))
        for row, frame in enumerate(frames):
            vi, xi, ti = v[row], x[row], frame.j / n
            if frame.guide is not None:  # RTC: pull the clean estimate toward the previous chunk
                estimate = xi + (1 - ti) * vi
                estimate = estimate + frame.guide[:, None] * (frame.target - estimate)
                vi = (estimate - xi) / (1 - ti)
            frame.x = xi + vi / n
            frame.j += 1
            if frame.delay:  # the frozen prefix, on its straight path: exactly prev_actions[:d] at t = 1
                done = frame.j / n
                frame.x[:frame.delay] = (1 - done) * frame.x0[:frame.delay] + done * frame.target[:frame.delay]
