"""The flow policy's plugin_args and one checked frame.

    FlowPolicyConfig.from_args({"num_steps": 10, "horizon": 16})
    Frame.parse({"state": [...], "prev_actions": [[...]] * 6, "inference_delay": 2}, cfg)

A frame is one robot observation with, optionally, real-time chunking (RTC) fields:

    prev_actions       [k, action_dim]  the previous chunk's actions not yet executed when it was sent
    inference_delay    d, 0 <= d <= k   actions that will run while this frame is inferred: returned
                                        exactly as prev_actions[:d]
    execution_horizon  s, 1 <= s <= H   actions the robot executes from each chunk; positions
                                        d .. min(k, H - s) - 1 are guided toward prev_actions
    noise_seed         int              the frame's initial noise (default: derived from the frame)
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from phyai_ray.policy.config import PolicyConfig, policy_args
from phyai_ray.policy.frames import check_observation

OBSERVATION_KEYS = frozenset({"state", "step", "prompt", "noise_seed", "prev_actions", "inference_delay",
                              "execution_horizon"})


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


def _int(frame: dict[str, Any], key: str, default: Any, low: int, high: float | None = None) -> Any:
    value = frame.get(key, default)
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"'{key}' must be an int {span}, got {value!r}")
    return value


@dataclass(frozen=True)
class Frame:
    """One checked observation: what a rank admits (tensors on the CPU)."""

    state: torch.Tensor  # [state_dim] float32
    step: int
    noise_seed: int
    prev_actions: torch.Tensor | None  # [k, action_dim] float32
    inference_delay: int
    execution_horizon: int | None

    @classmethod
    def parse(cls, frame: Any, cfg: FlowPolicyConfig) -> "Frame":
        state = check_observation(frame, cfg.state_dim, OBSERVATION_KEYS)
        step = frame.get("step", 0)
        prev = frame.get("prev_actions")
        delay = _int(frame, "inference_delay", 0, 0, cfg.horizon)
        horizon = _int(frame, "execution_horizon", None, 1, cfg.horizon)
        if prev is not None:
            prev = torch.as_tensor(prev)
            if prev.dim() != 2 or prev.shape[1] != cfg.action_dim or prev.shape[0] > cfg.horizon \
                    or not prev.is_floating_point():
                raise ValueError(f"'prev_actions' must be float [k, {cfg.action_dim}] with k <= horizon={cfg.horizon} "
                                 f"(the previous chunk's actions not yet executed), got {list(prev.shape)} of {prev.dtype}")
            prev = prev.to(torch.float32)
            if not bool(torch.isfinite(prev).all()):
                raise ValueError("'prev_actions' holds NaN or infinite values")
        k = 0 if prev is None else prev.shape[0]
        if delay > k:
            raise ValueError(f"'inference_delay'={delay} must be <= k={k}, the number of prev_actions rows "
                             "(0 <= d <= k <= horizon): the first d actions are taken from prev_actions")
        if horizon is not None and prev is None:
            raise ValueError("'execution_horizon' needs 'prev_actions' (real-time chunking guides toward them)")
        seed = _int(frame, "noise_seed", None, 0)
        if seed is None:
            seed = derived_noise_seed(cfg.seed, step, state)
        return cls(state, step, seed, prev, delay, horizon)

    def to_payload(self) -> dict[str, Any]:
        return {"state": self.state, "step": self.step, "noise_seed": self.noise_seed,
                "prev_actions": self.prev_actions, "inference_delay": self.inference_delay,
                "execution_horizon": self.execution_horizon}


def derived_noise_seed(seed: int, step: int, state: torch.Tensor) -> int:
    """A frame's default noise seed: from the policy's seed, its step counter and its state bytes, so a
    frame sent again gets the same actions and consecutive frames differ."""
    return zlib.crc32(state.numpy().tobytes(), zlib.crc32(f"{seed}:{step}".encode())) & 0x7FFFFFFF


def rtc_weights(horizon: int, delay: int, k: int, execution_horizon: int | None) -> torch.Tensor:
    """RTC's guidance weight per chunk position: 1 on the frozen prefix [0, d), exponentially decaying
    over [d, end) with end = min(k, H - s), 0 after (Physical Intelligence's real-time chunking)."""
    end = k if execution_horizon is None else min(k, horizon - execution_horizon)
    w = torch.zeros(horizon)
    w[:delay] = 1.0
    for i in range(delay, max(end, delay)):
        c = (end - i) / (end - delay + 1)
        w[i] = c * (math.exp(c) - 1) / (math.e - 1)
    return w
