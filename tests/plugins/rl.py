"""A plain `torch.nn.Module` policy for RL tests: every control hook runs its documented default.

`linear_policy` is `nn.Linear(8, 4)` seeded by `plugin_args["seed"]`; `step({"x": ...})` returns
the module's output (optionally after sleeping `request["sleep"]` seconds) and records the tag.
It defines no sleep / wake_up / load_weights, so the defaults for an nn.Module apply.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from phyai_ray import Entry, register_plugin


class LinearPolicy(torch.nn.Module):
    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        super().__init__()
        torch.manual_seed(int(plugin_args.get("seed", 0)))
        self.linear = torch.nn.Linear(8, 4)
        self.tags: list[Any] = []

    @torch.no_grad()
    def step(self, request: dict[str, Any]) -> torch.Tensor:
        self.tags.append(request.get("tag"))
        if request.get("sleep"):
            time.sleep(float(request["sleep"]))
        return self.linear(torch.as_tensor(request["x"], dtype=torch.float32))

    def executed(self) -> list[Any]:
        return list(self.tags)

    def weight_numel(self) -> int:
        return self.linear.weight.numel()


@register_plugin
class LinearPolicyEntry(Entry):
    name = "linear_policy"

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> LinearPolicy:
        return LinearPolicy(plugin_args, ctx)
