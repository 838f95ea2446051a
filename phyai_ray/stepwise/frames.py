"""The one robot frame format every policy plugin parses (reference_policy, reference_flow_policy,
lerobot_policy), checked in the dispatcher before any rank sees it.

    {"state": float [state_dim],                              under the layout's `state_key`
                                                              (LeRobot: the checkpoint's, "observation.state")
     "observation.images.top": uint8 HWC or float CHW in [0, 1],  every camera the layout names (none for
                                                              the reference policies)
     "task": "pick up the cube",                              (or "prompt"; "" when absent)
     "step": int,                                             the robot's frame counter (optional)
     denoising policies only (`FrameLayout.denoised`):
     "noise": float32 [chunk, noise_dim],                     optional: the initial noise (parity hook)
     "noise_seed": int,                                       optional: the noise drawn from it
     "prev_actions": float [k, action_dim], "inference_delay": d, "execution_horizon": s}   optional RTC

The RTC fields mean what `rtc.py` says, for every policy; 0 <= d <= k <= chunk, 1 <= s <= chunk.
openpi-client frames name their fields openpi's way; `FrameLayout.aliases` renames them first
(`openpi_aliases`: "observation/image" -> the first camera, "observation/wrist_image" -> the
second, "observation/state" -> the state, "prompt" -> "task"); openpi's named client formats (DROID's
split state, ALOHA's nested CHW cameras, LIBERO's; `formats.py`) are mapped before that, by
`FrameLayout.openpi_format` or detected from the keys. Without `noise` and `noise_seed` the
seed is derived from the state, `step` and the layout's `salt` (a reference policy's seed) or else the
task, so a frame sent again gets the same chunk.

    layout = FrameLayout(state_dim=8, action_dim=7, chunk=16, aliases=openpi_aliases([], "state"))
    frame = parse_frame({"state": np.zeros(8), "prev_actions": np.zeros((6, 7)), "inference_delay": 2}, layout)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from phyai_ray.stepwise.fields import as_image, bounded_int, finite, floats, tensor
from phyai_ray.stepwise.formats import from_format

CONTROL_KEYS = frozenset({"task", "prompt", "step"})
DENOISING_KEYS = frozenset({"noise", "noise_seed", "prev_actions", "inference_delay", "execution_horizon"})
OPENPI_CAMERAS = ("observation/image", "observation/wrist_image", "observation/left_wrist_image")
MAX_INT = 2 ** 63 - 1


@dataclass(frozen=True)
class FrameLayout:
    """What a policy's frames hold: the state key and size, the cameras, the action chunk."""

    state_dim: int
    action_dim: int
    chunk: int  # actions per chunk (the horizon)
    state_key: str = "state"
    cameras: dict[str, tuple[int, ...]] = field(default_factory=dict)
    noise_dim: int | None = None  # the noise's width (LeRobot's max_action_dim); None: action_dim
    denoised: bool = True  # noise, noise_seed and the RTC fields allowed
    aliases: dict[str, str] = field(default_factory=dict)  # {openpi key: this layout's key}
    salt: str | None = None  # a derived noise seed's salt (None: the task)
    openpi_format: str | None = "auto"  # formats.py: droid, aloha, libero, lerobot (as given), auto (detected)

    @property
    def keys(self) -> frozenset[str]:
        return CONTROL_KEYS | (DENOISING_KEYS if self.denoised else frozenset()) | {self.state_key, *self.cameras}


@dataclass(frozen=True)
class RobotFrame:
    """One checked frame: what a rank admits (tensors on the CPU)."""

    state: torch.Tensor  # [state_dim] float32
    images: dict[str, torch.Tensor]  # {camera: float CHW in [0, 1]}
    task: str
    step: int
    noise: torch.Tensor | None = None  # [chunk, noise_dim] float32
    noise_seed: int = 0
    prev_actions: torch.Tensor | None = None  # [k, action_dim] float32
    inference_delay: int = 0
    execution_horizon: int | None = None


def openpi_aliases(cameras: list[str], state_key: str, given: dict[str, str] | None = None,
                   plugin: str = "the policy") -> dict[str, str]:
    """{openpi-client key: layout key}: `given` (checked against the layout's keys) or the default."""
    if given is None:
        return {**dict(zip(OPENPI_CAMERAS, cameras)), "observation/state": state_key, "prompt": "task"}
    if not isinstance(given, dict):
        raise ValueError(f'{plugin}: plugin_args["openpi_keys"] must be a dict {{openpi key: checkpoint key}}, '
                         f"got {type(given).__name__}")
    known = {*cameras, state_key, "task"}
    bad = {k: v for k, v in given.items() if v not in known}
    if bad:
        raise ValueError(f'{plugin}: plugin_args["openpi_keys"] maps to keys this checkpoint does not have: '
                         f"{bad}; its keys: {sorted(known)}")
    return dict(given)


def derived_noise_seed(state: torch.Tensor, salt: str, step: int) -> int:
    """A frame's default noise seed from its state bytes, its salt and its step counter: a frame sent
    again gets the same actions and consecutive frames differ."""
    return zlib.crc32(state.numpy().tobytes(), zlib.crc32(f"{salt}:{step}".encode())) & 0x7FFFFFFF


def parse_frame(frame: Any, layout: FrameLayout) -> RobotFrame:
    """The checked frame (a `RobotFrame` passes as it is), or ValueError naming the field."""
    if isinstance(frame, RobotFrame):
        return frame
    frame = _renamed(from_format(frame, layout.openpi_format, list(layout.cameras), layout.state_key), layout)
    state = _state(frame, layout)
    images = {k: as_image(frame[k], k) for k in layout.cameras}
    task = frame.get("task", frame.get("prompt", ""))
    if not isinstance(task, str):
        raise ValueError(f"'task' must be a string, got {type(task).__name__}")
    step = bounded_int(frame, "step", 0, MAX_INT) or 0
    if not layout.denoised:
        return RobotFrame(state, images, task, step)
    chunk, width = layout.chunk, layout.noise_dim or layout.action_dim
    noise = None if frame.get("noise") is None else \
        floats(frame["noise"], "noise", (chunk, width), f"[chunk={chunk}, {width}] (the initial noise)")
    seed = bounded_int(frame, "noise_seed", 0, MAX_INT)
    if seed is None:
        seed = derived_noise_seed(state, task if layout.salt is None else layout.salt, step)
    prev, delay, horizon = _rtc(frame, layout)
    return RobotFrame(state, images, task, step, noise, seed, prev, delay, horizon)


def _renamed(frame: Any, layout: FrameLayout) -> dict[str, Any]:
    """The frame under the layout's own keys (openpi names renamed), unknown keys refused."""
    if not isinstance(frame, dict):
        raise ValueError(f"a frame is a dict with {layout.state_key!r} (float [{layout.state_dim}])"
                         f"{', the cameras ' + str(sorted(layout.cameras)) if layout.cameras else ''} and "
                         f"optionally 'task'; got {type(frame).__name__}")
    renamed: dict[str, Any] = {}
    for key, value in frame.items():
        name = layout.aliases.get(key, key)
        if name in renamed:
            raise ValueError(f"the frame gives {name!r} twice (as {key!r} and under its own or another name)")
        renamed[name] = value
    unknown = sorted(set(renamed) - layout.keys)
    if unknown:
        raise ValueError(f"unknown frame keys {unknown}; this policy takes {sorted(layout.keys)} (unknown "
                         "observation keys are refused, so a misspelt field is never ignored)")
    missing = [k for k in (layout.state_key, *layout.cameras) if k not in renamed]
    if missing:
        raise ValueError(f"the frame lacks {missing}; this policy needs {layout.state_key!r} [{layout.state_dim}]"
                         f"{' and the cameras ' + str(sorted(layout.cameras)) if layout.cameras else ''}")
    return renamed


def _state(frame: dict[str, Any], layout: FrameLayout) -> torch.Tensor:
    key, n = layout.state_key, layout.state_dim
    state = tensor(frame[key], key)
    if state.numel() != n or not (state.is_floating_point() or state.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"'{key}' must hold {n} numbers (float [{n}]), got shape {list(state.shape)} of {state.dtype}")
    return finite(state.to(torch.float32).reshape(-1), key)


def _rtc(frame: dict[str, Any], layout: FrameLayout) -> tuple[torch.Tensor | None, int, int | None]:
    """(prev_actions, inference_delay, execution_horizon), checked together."""
    chunk, dim = layout.chunk, layout.action_dim
    prev = None
    if frame.get("prev_actions") is not None:
        prev = floats(frame["prev_actions"], "prev_actions", (None, dim),
                      f"[k, {dim}] with k <= horizon={chunk} (the previous chunk's actions not yet executed, "
                      "in the returned actions' units)")
        if prev.shape[0] > chunk:
            raise ValueError(f"'prev_actions' must be float [k, {dim}] with k <= horizon={chunk}, got "
                             f"{list(prev.shape)}")
    k = 0 if prev is None else prev.shape[0]
    delay = bounded_int(frame, "inference_delay", 0, chunk) or 0
    if delay > k:
        raise ValueError(f"'inference_delay'={delay} must be <= k={k}, the number of prev_actions rows "
                         "(0 <= d <= k <= horizon): the first d actions are taken from prev_actions")
    horizon = bounded_int(frame, "execution_horizon", 1, chunk)
    if horizon is not None and prev is None:
        raise ValueError("'execution_horizon' needs 'prev_actions' (real-time chunking guides toward them)")
    return prev, delay, horizon
