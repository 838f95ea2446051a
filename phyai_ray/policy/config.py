"""A robot policy's plugin_args: sizes and seed, checked (known names, positive ints).

    PolicyConfig.from_args({"state_dim": 8, "horizon": 10})          # reference_policy's
    policy_args(FlowPolicyConfig, {"num_steps": 4}, "reference_flow_policy", flags=("per_step",))

A policy with more arguments subclasses the frozen dataclass and passes its own name and its
boolean `flags` to `policy_args`, so every policy refuses an unknown or non-positive value alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
