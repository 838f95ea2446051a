"""One robot frame: the observation check every policy runs, and `step` as a batch of one.

    state = check_observation({"state": np.zeros(8), "step": 3}, 8, frozenset({"state", "step"}))
    class MyPolicy(StepsInBatches):          # defines step_batch(frames); step(frame) comes free
        ...
"""

from __future__ import annotations

from typing import Any

import torch


def check_observation(request: Any, state_dim: int, keys: frozenset[str]) -> Any:
    """A robot observation's `state` (a float32 tensor [state_dim]) after checking its keys and its
    optional `step`; ValueError naming the field otherwise."""
    if not isinstance(request, dict) or "state" not in request:
        raise ValueError("an observation is a dict with 'state' (float32 [state_dim]), e.g. {'state': np.zeros(8)}")
    unknown = sorted(set(request) - keys)
    if unknown:
        raise ValueError(f"unknown observation keys {unknown}; known: {sorted(keys)}")
    state = torch.as_tensor(request["state"])
    if state.numel() != state_dim or not (state.is_floating_point() or state.dtype == torch.int64):
        raise ValueError(f"'state' must hold {state_dim} numbers, got shape {list(state.shape)} of {state.dtype}")
    step = request.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"'step' must be an int >= 0, got {step!r}")
    return state.to(torch.float32).reshape(-1)


class StepsInBatches:
    """`step(frame)` as a batch of one (`step_batch`): {"actions": ...} on the output rank, None elsewhere."""

    @torch.inference_mode()
    def step(self, request: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        out = self.step_batch([request])
        return None if out is None else out[0]
