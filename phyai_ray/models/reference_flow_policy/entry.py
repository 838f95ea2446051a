"""`ReferenceFlowPolicyEntry`: the built-in flow-matching robot policy, `plugin="reference_flow_policy"`.

    phyai-ray serve reference_flow_policy --dense-tp-size 2 --device cpu --cpus-per-rank 0.5
    python examples/robot_fleet.py --url ws://127.0.0.1:8000/v1/openpi --robots 8 --hz 20

One observation `{"state": float32 [state_dim], "step": int, "noise_seed": int, "prev_actions":
float32 [k, action_dim], "inference_delay": d, "execution_horizon": s}` (all but `state` optional;
the robot frame format of phyai_ray/stepwise/frames.py) -> `{"actions": float32 [horizon, action_dim]}`. Each frame is one sequence of the
iteration protocol and takes one denoising step per iteration, so robots share every step
(`per_step=False` runs whole frames as batched steps instead). Its metadata frame (openpi's
protocol) names the sizes and the number of steps.
"""

from __future__ import annotations

from typing import Any

from phyai_ray.errors import RequestAbortedError
from phyai_ray.models.reference_flow_policy.config import FlowPolicyConfig, frame_layout
from phyai_ray.models.reference_flow_policy.model import ReferenceFlowPolicy
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.iteration import SequenceSpec
from phyai_ray.plugins.registry import register_plugin
from phyai_ray.plugins.signature import TensorSpec
from phyai_ray.stepwise.frames import RobotFrame, parse_frame


@register_plugin
class ReferenceFlowPolicyEntry(Entry):
    """Flow-matching action-chunk policy: Euler steps over a velocity network, real-time chunking, dense TP."""

    name = "reference_flow_policy"
    parallel_domains = frozenset({"dense"})
    default_max_batch_size = 64  # with per_step=False: robots' whole frames share steps
    inputs = (TensorSpec("state", "FP32", (-1,)),)
    outputs = (TensorSpec("actions", "FP32", (-1, -1)),)

    def __init__(self, plugin_args: dict[str, Any] | None = None) -> None:
        self.configure(plugin_args)

    def configure(self, plugin_args: dict[str, Any] | None) -> None:
        self.config = FlowPolicyConfig.from_args(plugin_args)
        self.layout = frame_layout(self.config)

    @property
    def iterative(self) -> bool:
        return self.config.per_step

    def validate_parallel(self, parallel: Any) -> None:
        from phyai_ray.errors import ParallelConfigError

        if "dense" in parallel.explicit_domains and parallel.dense.dp_size > 1:
            raise ParallelConfigError(f"reference_flow_policy denoises whole frames; dense dp_size="
                                      f"{parallel.dense.dp_size} would split one; use dense tp_size")

    def validate_request(self, request: Any) -> RobotFrame:
        return parse_frame(request, self.layout)

    def sequences(self, request: Any) -> list[SequenceSpec]:
        """One sequence per frame (one slot, one row per denoising step)."""
        return [SequenceSpec(payload=parse_frame(request, self.layout), cost=1,
                             steps=self.config.num_steps)]

    def gather(self, request: Any, outputs: list[Any]) -> dict[str, Any]:
        [out] = outputs
        if not isinstance(out, dict):  # pause(mode="abort") ended it between two denoising steps
            raise RequestAbortedError("the frame was aborted before its last denoising step; send it again")
        return out

    def policy_metadata(self) -> dict[str, Any]:
        c = self.config
        return {"policy": self.name, "state_dim": c.state_dim, "action_dim": c.action_dim,
                "action_horizon": c.horizon, "num_steps": c.num_steps, "seed": c.seed,
                "real_time_chunking": ["prev_actions", "inference_delay", "execution_horizon"]}

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> ReferenceFlowPolicy:
        return ReferenceFlowPolicy(FlowPolicyConfig.from_args(plugin_args), ctx)
