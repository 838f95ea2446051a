"""`ReferencePolicyEntry`: the built-in example robot policy, `plugin="reference_policy"`.

    phyai-ray serve reference_policy --dense-tp-size 2 --replicas 2 --device cpu --cpus-per-rank 0.5
    python examples/robot_client.py --url ws://127.0.0.1:8000/v1/openpi --steps 200

One observation `{"state": float32 [state_dim], "step": int (optional), "prompt": str (optional)}`
(the robot frame format of phyai_ray/stepwise/frames.py, without noise or RTC fields)
-> `{"actions": float32 [horizon, action_dim]}`, deterministic from plugin_args["seed"]. Its
metadata frame (openpi's protocol) names the sizes, so a client knows the action chunk it gets.
"""

from __future__ import annotations

from typing import Any

from phyai_ray.models.reference_policy.model import PolicyConfig, ReferencePolicy, frame_layout
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.registry import register_plugin
from phyai_ray.plugins.signature import TensorSpec
from phyai_ray.stepwise.frames import RobotFrame, parse_frame


@register_plugin
class ReferencePolicyEntry(Entry):
    """Action-chunk policy: a seeded MLP over the robot state, dense TP capable."""

    name = "reference_policy"
    parallel_domains = frozenset({"dense"})
    default_max_batch_size = 64  # robots on one group share steps (step_batch: one row per frame)
    inputs = (TensorSpec("state", "FP32", (-1,)),)
    outputs = (TensorSpec("actions", "FP32", (-1, -1)),)

    def __init__(self, plugin_args: dict[str, Any] | None = None) -> None:
        self.config = PolicyConfig.from_args(plugin_args)

    def configure(self, plugin_args: dict[str, Any]) -> None:
        self.config = PolicyConfig.from_args(plugin_args)

    def validate_parallel(self, parallel: Any) -> None:
        from phyai_ray.errors import ParallelConfigError

        if "dense" in parallel.explicit_domains and parallel.dense.dp_size > 1:
            raise ParallelConfigError(f"reference_policy acts on one observation at a time; dense dp_size="
                                      f"{parallel.dense.dp_size} would split a batch of 1; use dense tp_size")

    def validate_request(self, request: Any) -> RobotFrame:
        return parse_frame(request, frame_layout(self.config))

    def policy_metadata(self) -> dict[str, Any]:
        c = self.config
        return {"policy": self.name, "state_dim": c.state_dim, "action_dim": c.action_dim,
                "action_horizon": c.horizon, "seed": c.seed}

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> ReferencePolicy:
        return ReferencePolicy(PolicyConfig.from_args(plugin_args), ctx)
