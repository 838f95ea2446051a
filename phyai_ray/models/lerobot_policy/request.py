"""One robot frame for a LeRobot policy, checked in the dispatcher before any rank sees it.

    {"observation.state": float [state_dim],                   the checkpoint's input feature names
     "observation.images.top": uint8 HWC or float CHW in [0, 1],  every camera the checkpoint names
     "task": "pick up the cube",                               (or "prompt"; "" when absent)
     "noise": float32 [chunk_size, max_action_dim],            optional: the initial noise (parity hook)
     "noise_seed": int,                                        optional: the noise drawn from it
     "prev_actions": float [k, action_dim], "inference_delay": d, "execution_horizon": s}   optional RTC

`prev_actions` are in the space of the returned actions (the robot's units); they are normalized
like LeRobot's actions before guiding. 0 <= d <= k <= chunk_size and 1 <= s <= chunk_size.
openpi-client frames name their fields openpi's way; `Layout.aliases` renames them first (default
below, `plugin_args["openpi_keys"]` replaces it): "observation/image" -> the first camera,
"observation/wrist_image" -> the second, "observation/state" -> the state feature, "prompt" -> "task".
Without `noise` and `noise_seed` the seed is derived from the state, the task and `step`, so a frame
sent again gets the same chunk.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from phyai_ray.models.lerobot_policy.processing import as_image

CONTROL_KEYS = frozenset({"task", "prompt", "noise", "noise_seed", "prev_actions", "inference_delay",
                          "execution_horizon", "step"})


@dataclass(frozen=True)
class Layout:
    """What a checkpoint's frames hold: camera keys and shapes, the state key and sizes."""

    cameras: dict[str, tuple[int, ...]]
    state_key: str
    state_dim: int
    action_dim: int
    chunk: int
    max_action_dim: int
    aliases: dict[str, str]


def openpi_aliases(cameras: list[str], state_key: str, given: dict[str, str] | None) -> dict[str, str]:
    """{openpi-client key: checkpoint key}: `given` (checked against the checkpoint's keys) or the default."""
    if given is None:
        names = ("observation/image", "observation/wrist_image", "observation/left_wrist_image")
        out = dict(zip(names, cameras))
        return {**out, "observation/state": state_key, "prompt": "task"}
    if not isinstance(given, dict):
        raise ValueError(f'lerobot_policy: plugin_args["openpi_keys"] must be a dict {{openpi key: checkpoint key}}, '
                         f"got {type(given).__name__}")
    known = {*cameras, state_key, "task"}
    bad = {k: v for k, v in given.items() if v not in known}
    if bad:
        raise ValueError(f'lerobot_policy: plugin_args["openpi_keys"] maps to keys this checkpoint does not have: '
                         f"{bad}; its keys: {sorted(known)}")
    return dict(given)


def _tensor(value: Any, key: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"'{key}' must be an array of numbers, got {type(value).__name__}") from exc


def _int(frame: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = frame.get(key)
    if value is None:
        return None
    if isinstance(value, (np.integer, torch.Tensor)) and np.ndim(value) == 0:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"'{key}' must be an int in [{low}, {high}], got {value!r}")
    return value


def _floats(frame: dict[str, Any], key: str, shape: tuple[int | None, ...], hint: str) -> torch.Tensor:
    t = _tensor(frame[key], key)
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)) \
            or not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"'{key}' must be float {hint}, got shape {list(t.shape)} of {t.dtype}")
    t = t.to(torch.float32)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"'{key}' holds NaN or infinite values")
    return t


def parse_frame(frame: Any, layout: Layout) -> dict[str, Any]:
    """The checked payload a rank admits (CPU tensors), or ValueError naming the field."""
    if not isinstance(frame, dict):
        raise ValueError(f"a frame is a dict with {layout.state_key!r}, the cameras {sorted(layout.cameras)} "
                         f"and 'task'; got {type(frame).__name__}")
    renamed: dict[str, Any] = {}
    for key, value in frame.items():
        name = layout.aliases.get(key, key)
        if name in renamed:
            raise ValueError(f"the frame gives {name!r} twice (as {key!r} and under its own or another name)")
        renamed[name] = value
    frame = renamed
    known = CONTROL_KEYS | {layout.state_key} | set(layout.cameras)
    unknown = sorted(set(frame) - known)
    if unknown:
        raise ValueError(f"unknown frame keys {unknown}; this checkpoint takes {sorted(known)}")
    missing = [k for k in (layout.state_key, *layout.cameras) if k not in frame]
    if missing:
        raise ValueError(f"the frame lacks {missing}; this checkpoint needs {layout.state_key!r} "
                         f"[{layout.state_dim}] and the cameras {sorted(layout.cameras)}")
    state = _floats(frame, layout.state_key, (layout.state_dim,), f"[{layout.state_dim}]")
    images = {k: as_image(frame[k], k, shape) for k, shape in layout.cameras.items()}
    task = frame.get("task", frame.get("prompt", ""))
    if not isinstance(task, str):
        raise ValueError(f"'task' must be a string, got {type(task).__name__}")
    out: dict[str, Any] = {"state": state, "images": images, "task": task}
    chunk, dim = layout.chunk, layout.max_action_dim
    if frame.get("noise") is not None:
        out["noise"] = _floats(frame, "noise", (chunk, dim), f"[chunk_size={chunk}, max_action_dim={dim}]")
    seed = _int(frame, "noise_seed", 0, 2 ** 63 - 1)
    step = _int(frame, "step", 0, 2 ** 63 - 1) or 0
    if seed is None:
        seed = zlib.crc32(state.numpy().tobytes(), zlib.crc32(f"{task}:{step}".encode())) & 0x7FFFFFFF
    out["noise_seed"] = seed
    prev = None
    if frame.get("prev_actions") is not None:
        prev = _floats(frame, "prev_actions", (None, layout.action_dim),
                       f"[k, {layout.action_dim}] with k <= chunk_size={chunk} (the previous chunk's actions not "
                       "yet executed, in the returned space)")
        if prev.shape[0] > chunk:
            raise ValueError(f"'prev_actions' has k={prev.shape[0]} rows, more than chunk_size={chunk}")
    k = 0 if prev is None else prev.shape[0]
    delay = _int(frame, "inference_delay", 0, chunk) or 0
    if delay > k:
        raise ValueError(f"'inference_delay'={delay} must be <= k={k}, the number of prev_actions rows")
    horizon = _int(frame, "execution_horizon", 1, chunk)
    if horizon is not None and prev is None:
        raise ValueError("'execution_horizon' needs 'prev_actions' (real-time chunking guides toward them)")
    out.update(prev_actions=prev, inference_delay=delay, execution_horizon=horizon)
    return out
