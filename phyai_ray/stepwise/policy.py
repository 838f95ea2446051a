"""What robot-policy plugins share besides their frames: checked sizes, and `step` as a batch of one.

    PolicyConfig.from_args({"state_dim": 8, "horizon": 10})          # reference_policy's
    policy_args(FlowPolicyConfig, {"num_steps": 4}, "reference_flow_policy", flags=("per_step",))
    class MyPolicy(StepsInBatches):          # defines step_batch(frames); step(frame) comes free

A policy with more arguments subclasses the frozen dataclass and passes its own name and its
boolean `flags` to `policy_args`, so every policy refuses an unknown or non-positive value alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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


class StepsInBatches:
    """A policy whose frames run as batches: `step(frame)` is `step_batch([frame])`, {"actions": ...} on
    the output rank, None elsewhere. A subclass defines `step_batch`."""

    def step_batch(self, requests: list[Any]) -> list[dict[str, torch.Tensor]] | None:
        """Several frames as one batch; one {"actions": ...} per frame, in order (None off the output rank)."""
        raise NotImplementedError(f"{type(self).__name__} must define step_batch(requests)")

    @torch.inference_mode()
    def step(self, request: Any) -> dict[str, torch.Tensor] | None:
        out = self.step_batch([request])
        return None if out is None else out[0]
