"""Real-time chunking (RTC): a robot's new chunk continues the actions it has not executed yet.

One meaning for every policy. A frame may carry (`frames.py` checks them):

    prev_actions       [k, action_dim]  the previous chunk's actions not yet executed when it was sent,
                                        in the units of the returned actions
    inference_delay    d, 0 <= d <= k   actions that run while this frame is inferred: the frozen
                                        prefix, weight 1
    execution_horizon  s, 1 <= s <= H   where the guided span ends: positions [d, min(s, k)) are guided
                                        toward prev_actions with decaying weights, positions from
                                        min(s, k) on are the policy's own (LeRobot's field; the paper's
                                        H - s). Without it, the policy's `RTCRule.execution_horizon`
                                        (None: the whole of prev_actions)

Weights over the chunk (LeRobot 0.4.4's get_prefix_weights; `start` = min(d, end)): 1 on [0, start),
then by schedule ZEROS / ONES / LINEAR / EXP over [start, end), 0 after; EXP is Physical
Intelligence's c (e^c - 1) / (e - 1) with c = (end - i) / (end - start + 1).

Guidance at every Euler step, in the time t from noise (0) to actions (1), v the velocity toward the
actions, `remaining` = 1 - t, x1 = x_t + remaining * v the clean estimate:

    rule.max_guidance_weight None    the estimate pulled toward prev_actions by the weights and v taken
                                     from the pulled estimate: v' = (x1 + w (prev - x1) - x_t) / remaining
    rule.max_guidance_weight = b     LeRobot's (the RTC paper's) gain: v' = v + g w (prev - x1) with
                                     g = min(b, (1 - tau) / tau * ((1 - tau)^2 + tau^2) / (1 - tau)^2),
                                     tau = 1 - remaining
    rule.frozen_prefix               after each step the first d actions are put back on the straight
                                     path (1 - t) x_0 + t prev, so they ARE prev_actions[:d] at t = 1
                                     (bit for bit); LeRobot's policies only guide them (weight 1), as
                                     LeRobot does, so their chunks equal LeRobot's

    rule = RTCRule(max_guidance_weight=None, frozen_prefix=True)          # reference_flow_policy's
    guide = Guidance.build(rule, prev, delay=2, horizon=None, chunk=16, dim=7, device="cpu")
    v = guide.velocity(x, v, remaining=1 - t)                             # per frame, per step
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SCHEDULES = ("ZEROS", "ONES", "LINEAR", "EXP")


@dataclass(frozen=True)
class RTCRule:
    """How a policy guides: the weights' schedule, the gain, its default guided span, the frozen prefix."""

    schedule: str = "EXP"
    max_guidance_weight: float | None = None  # None: the pulled estimate (see the module docstring)
    execution_horizon: int | None = None  # a frame without one: the guided span ends here (None: at k)
    frozen_prefix: bool = True

    @classmethod
    def lerobot(cls, config: dict | None) -> "RTCRule":
        """A LeRobot folder's rtc_config (LeRobot's defaults when it has none)."""
        config = config or {}
        schedule = str(config.get("prefix_attention_schedule", "LINEAR")).split(".")[-1].upper()
        if schedule not in SCHEDULES:
            raise ValueError(f"lerobot_policy: rtc_config.prefix_attention_schedule={schedule!r}; "
                             f"supported: {', '.join(SCHEDULES)}")
        return cls(schedule, float(config.get("max_guidance_weight", 10.0)), int(config.get("execution_horizon", 10)),
                   frozen_prefix=False)


def prefix_weights(schedule: str, delay: int, end: int, total: int) -> torch.Tensor:
    """[total] guidance weights, as LeRobot 0.4.4 builds them (see the module docstring)."""
    start = min(delay, end)
    if schedule == "ZEROS":
        w = torch.zeros(total)
        w[:start] = 1.0
        return w
    if schedule == "ONES":
        w = torch.ones(total)
        w[end:] = 0.0
        return w
    steps = total - max(total - end, 0) - start
    lin = torch.tensor([]) if end <= start or steps <= 0 else torch.linspace(1, 0, steps + 2)[1:-1]
    if schedule == "EXP":
        lin = lin * torch.expm1(lin).div(math.e - 1)
    if total - end > 0:
        lin = torch.cat([lin, torch.zeros(total - end)])
    if min(start, total) > 0:
        lin = torch.cat([torch.ones(min(start, total)), lin])
    return lin


@dataclass
class Guidance:
    """One frame's RTC: its previous chunk (padded with zeros to [chunk, dim]), weights [chunk, 1], delay."""

    target: torch.Tensor  # [chunk, dim]
    weights: torch.Tensor  # [chunk, 1]
    delay: int
    rule: RTCRule

    @classmethod
    def build(cls, rule: RTCRule, prev: torch.Tensor, delay: int, horizon: int | None, chunk: int, dim: int,
              device: Any = "cpu") -> "Guidance":
        """`prev` [k, <= dim] (in the space the policy denoises), the frame's d and execution_horizon."""
        k = prev.shape[0]
        horizon = rule.execution_horizon if horizon is None else horizon
        end = k if horizon is None else min(horizon, k)
        target = torch.zeros(chunk, dim, dtype=torch.float32, device=device)
        target[:k, :prev.shape[1]] = prev
        weights = prefix_weights(rule.schedule, delay, end, chunk)[:, None].to(device)
        return cls(target, weights, delay, rule)

    def velocity(self, x: torch.Tensor, v: torch.Tensor, remaining: float) -> torch.Tensor:
        """The guided velocity for this frame's x [chunk, dim] and v (toward the actions), `remaining`
        = 1 - t of the flow time still to go."""
        x1 = x + remaining * v
        if self.rule.max_guidance_weight is None:
            return (x1 + self.weights * (self.target - x1) - x) / remaining
        tau = 1.0 - remaining
        err = (self.target - x1) * self.weights
        one = 1.0 - tau
        c = one / tau if tau != 0 else math.inf
        inv_r2 = (one ** 2 + tau ** 2) / (one ** 2) if one != 0 else math.inf
        g = c * inv_r2
        g = self.rule.max_guidance_weight if math.isnan(g) or g == math.inf else min(g, self.rule.max_guidance_weight)
        return v + g * err

    def freeze(self, x: torch.Tensor, x0: torch.Tensor, t: float) -> None:
        """With a frozen prefix: x[:d] on the straight path (1 - t) x0 + t prev at time t (in place)."""
        d = self.delay
        if self.rule.frozen_prefix and d:
            x[:d] = (1 - t) * x0[:d] + t * self.target[:d]


class GuidanceBatch:
    """The guidance of a batch of frames as stacked tensors, built once while the batch stays the same:
    one set of ops per step for every guided row instead of a Python loop over robots.

        batch = GuidanceBatch([frame.guidance for frame in frames], device)   # None: an unguided row
        v = batch.velocity(x, v, remaining)        # x, v [B, chunk, dim], remaining [B]: rows guided
    """

    def __init__(self, guides: list[Guidance | None], device: Any = "cpu") -> None:
        rows = [i for i, g in enumerate(guides) if g is not None]
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.rule = guides[rows[0]].rule if rows else None
        if any(guides[i].rule != self.rule for i in rows):
            raise ValueError("a GuidanceBatch guides by one RTCRule; the frames carry several")
        self.target = torch.stack([guides[i].target for i in rows]).to(device) if rows else None
        self.weights = torch.stack([guides[i].weights for i in rows]).to(device) if rows else None

    def velocity(self, x: torch.Tensor, v: torch.Tensor, remaining: torch.Tensor) -> torch.Tensor:
        """`Guidance.velocity` of every guided row at its own `remaining` [B]; unguided rows as given."""
        if self.target is None:
            return v
        xs, vs = x.index_select(0, self.rows), v.index_select(0, self.rows)
        left = remaining.index_select(0, self.rows).to(torch.float64)
        x1 = xs + left.to(xs.dtype)[:, None, None] * vs
        if self.rule.max_guidance_weight is None:
            guided = (x1 + self.weights * (self.target - x1) - xs) / left.to(xs.dtype)[:, None, None]
        else:
            tau = 1.0 - left
            one = 1.0 - tau
            g = (one / tau) * ((one ** 2 + tau ** 2) / one ** 2)
            bound = self.rule.max_guidance_weight
            g = torch.where(torch.isnan(g) | torch.isinf(g), torch.full_like(g, bound), g.clamp(max=bound))
            guided = vs + g.to(xs.dtype)[:, None, None] * ((self.target - x1) * self.weights)
        return v.index_copy(0, self.rows, guided)
