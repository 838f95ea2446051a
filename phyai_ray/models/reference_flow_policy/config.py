"""The flow policy's plugin_args and its robot frames.

    FlowPolicyConfig.from_args({"num_steps": 10, "horizon": 16})
    parse_frame({"state": [...], "prev_actions": [[...]] * 6, "inference_delay": 2}, frame_layout(cfg))

A frame is the robot frame format of phyai_ray/stepwise/frames.py: one observation (`state`, `step`,
`prompt`), its initial noise (`noise` [horizon, action_dim] or `noise_seed`; by default derived from
the policy's seed, the frame's step and its state) and, optionally, real-time chunking fields
(`prev_actions`, `inference_delay`, `execution_horizon`), which mean what phyai_ray/stepwise/rtc.py
says; this policy freezes the prefix: its first d actions are prev_actions[:d] bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phyai_ray.stepwise.frames import FrameLayout, openpi_aliases
from phyai_ray.stepwise.policy import PolicyConfig, policy_args
from phyai_ray.stepwise.rtc import RTCRule

RTC = RTCRule(schedule="EXP", max_guidance_weight=None, execution_horizon=None, frozen_prefix=True)


@dataclass(frozen=True)
class FlowPolicyConfig(PolicyConfig):
    """plugin_args of the flow policy: reference_policy's sizes and seed, the Euler steps, and whether
    it batches per step (False: a frame is one whole step, batched as whole requests)."""

    horizon: int = 16
    num_steps: int = 10
    per_step: bool = True

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "FlowPolicyConfig":
        return policy_args(cls, args, "reference_flow_policy", flags=("per_step",))


def frame_layout(cfg: FlowPolicyConfig) -> FrameLayout:
    """Its frames: `state` (openpi's "observation/state"), no cameras; derived noise seeds salted by its seed."""
    return FrameLayout(state_dim=cfg.state_dim, action_dim=cfg.action_dim, chunk=cfg.horizon,
                       aliases=openpi_aliases([], "state"), salt=str(cfg.seed))
