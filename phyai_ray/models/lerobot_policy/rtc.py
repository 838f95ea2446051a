"""Real-time chunking on LeRobot policies, per robot: LeRobot 0.4.4's guided formula.

LeRobot runs time from 1 (noise) down to 0 (actions) and, at every Euler step, corrects the velocity
toward the previous chunk's actions still to be executed (`prev`, padded with zeros to the chunk):

    x1     = x_t - time * v                      the clean estimate
    err    = (prev - x1) * w                     w: the prefix weights (below), per chunk position
    tau    = 1 - time
    g      = min(max_guidance_weight, (1 - tau) / tau * ((1 - tau)^2 + tau^2) / (1 - tau)^2)
    v     <- v - g * err                         (LeRobot gets err through autograd: d x1 / d x_t = 1)

Prefix weights over the chunk (LeRobot's get_prefix_weights, start = min(delay, end), end =
min(execution_horizon, len(prev))): 1 on [0, start), then by schedule ZEROS / ONES / LINEAR / EXP
over [start, end), 0 after. LeRobot takes one delay and horizon per call; here each robot has its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULES = ("ZEROS", "ONES", "LINEAR", "EXP")


@dataclass(frozen=True)
class RTCSettings:
    """The folder's rtc_config (LeRobot's defaults when it has none): schedule, max guidance, horizon."""

    schedule: str = "LINEAR"
    max_guidance_weight: float = 10.0
    execution_horizon: int = 10

    @classmethod
    def from_config(cls, config: dict | None) -> "RTCSettings":
        config = config or {}
        schedule = str(config.get("prefix_attention_schedule", "LINEAR")).split(".")[-1].upper()
        if schedule not in SCHEDULES:
            raise ValueError(f"lerobot_policy: rtc_config.prefix_attention_schedule={schedule!r}; "
                             f"supported: {', '.join(SCHEDULES)}")
        return cls(schedule, float(config.get("max_guidance_weight", 10.0)),
                   int(config.get("execution_horizon", 10)))


def prefix_weights(settings: RTCSettings, delay: int, end: int, total: int) -> torch.Tensor:
    """[total] guidance weights, as LeRobot 0.4.4 builds them."""
    start = min(delay, end)
    if settings.schedule == "ZEROS":
        w = torch.zeros(total)
        w[:start] = 1.0
        return w
    if settings.schedule == "ONES":
        w = torch.ones(total)
        w[end:] = 0.0
        return w
    steps = total - max(total - end, 0) - start
    lin = torch.tensor([]) if end <= start or steps <= 0 else torch.linspace(1, 0, steps + 2)[1:-1]
    if settings.schedule == "EXP":
        lin = lin * torch.expm1(lin).div(math.e - 1)
    if total - end > 0:
        lin = torch.cat([lin, torch.zeros(total - end)])
    if min(start, total) > 0:
        lin = torch.cat([torch.ones(min(start, total)), lin])
    return lin


@dataclass
class Guidance:
    """One robot's RTC: its previous chunk (model space, padded to [chunk, max_action_dim]) and weights."""

    prev: torch.Tensor  # [chunk, D]
    weights: torch.Tensor  # [chunk, 1]
    max_guidance_weight: float

    @classmethod
    def build(cls, settings: RTCSettings, prev: torch.Tensor, delay: int, horizon: int | None,
              chunk: int, dim: int) -> "Guidance":
        horizon = settings.execution_horizon if horizon is None else horizon
        horizon = min(horizon, prev.shape[0])
        padded = torch.zeros(chunk, dim, dtype=torch.float32)
        padded[:prev.shape[0], :prev.shape[1]] = prev
        w = prefix_weights(settings, delay, horizon, chunk)[:, None]
        return cls(padded, w, settings.max_guidance_weight)

    def correct(self, x: torch.Tensor, v: torch.Tensor, time: float) -> torch.Tensor:
        """The guided velocity for this robot's x [chunk, D] and v at LeRobot's `time`."""
        tau = 1.0 - time
        x1 = x - time * v
        err = (self.prev.to(x.device) - x1) * self.weights.to(x.device)
        one = 1.0 - tau
        c = one / tau if tau != 0 else math.inf
        inv_r2 = (one ** 2 + tau ** 2) / (one ** 2) if one != 0 else math.inf
        g = c * inv_r2
        g = self.max_guidance_weight if math.isnan(g) or g == math.inf else min(g, self.max_guidance_weight)
        return v - g * err
