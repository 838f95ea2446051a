"""openpi's clients as they are: their observation formats mapped onto a policy's own frame keys.

openpi's example clients send one of these (keys as in openpi's examples/<robot>/main.py):

    droid    "observation/exterior_image_1_left", "observation/wrist_image_left"   uint8 HWC cameras
             "observation/joint_position" [7] + "observation/gripper_position" [1]   a split state
    aloha    "images": {"cam_high", "cam_left_wrist", "cam_right_wrist", "cam_low"}  nested, uint8 CHW
             "state" [14]
    libero   "observation/image", "observation/wrist_image"                        uint8 HWC cameras
             "observation/state" [8]
    lerobot  the checkpoint's own keys ("observation.state", "observation.images.top", ...)

each with "prompt". A format's cameras fill the policy's cameras in order (the first camera of the
format to the policy's first camera, ...); a format camera beyond the policy's cameras is left out,
as openpi's own input transforms leave out ALOHA's cam_low. The state parts are concatenated in the
order listed. The format is `plugin_args["openpi_format"]`, or (None, "auto") detected from the
frame's keys: the first format whose keys are all present; a frame matching none passes as it is.

    frame = from_format({"images": {"cam_high": chw}, "state": s, "prompt": "fold"}, "auto",
                        cameras=["observation.images.top"], state_key="observation.state")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Format:
    """One client's observation keys: its cameras in the order they fill a policy's, its state parts."""

    cameras: tuple[str, ...]
    state: tuple[str, ...]
    nested: str | None = None  # the key of a dict of cameras ("images"); camera names are inside it

    def matches(self, frame: dict[str, Any]) -> bool:
        if self.nested is not None:
            return isinstance(frame.get(self.nested), dict) and all(k in frame for k in self.state)
        return all(k in frame for k in self.state) and self.cameras[0] in frame


FORMATS = {
    "droid": Format(("observation/exterior_image_1_left", "observation/wrist_image_left"),
                    ("observation/joint_position", "observation/gripper_position")),
    "aloha": Format(("cam_high", "cam_left_wrist", "cam_right_wrist", "cam_low"), ("state",), nested="images"),
    "libero": Format(("observation/image", "observation/wrist_image"), ("observation/state",)),
}
NAMES = ("auto", "lerobot", *FORMATS)


def check_format(name: Any, plugin: str) -> None:
    if name is not None and name not in NAMES:
        raise ValueError(f'{plugin}: plugin_args["openpi_format"]={name!r}; supported: {list(NAMES)} '
                         "(auto: detected from each frame's keys)")


def detect(frame: dict[str, Any]) -> str | None:
    """The name of the first format the frame's keys match, or None (the policy's own keys)."""
    for name, fmt in FORMATS.items():
        if fmt.matches(frame):
            return name
    return None


def from_format(frame: Any, name: str | None, cameras: list[str], state_key: str) -> Any:
    """`frame` under the policy's keys when it is in format `name` ("auto": detected); otherwise as given."""
    if not isinstance(frame, dict) or name == "lerobot":
        return frame
    name = detect(frame) if name in (None, "auto") else name
    if name is None:
        return frame
    fmt = FORMATS[name]
    if not fmt.matches(frame):
        raise ValueError(f"the frame is not in openpi's {name!r} format (plugin_args['openpi_format']): it needs "
                         f"{[*fmt.state, fmt.nested or fmt.cameras[0]]}, got keys {sorted(frame)}")
    source = frame[fmt.nested] if fmt.nested else frame
    used = set(fmt.state) | ({fmt.nested} if fmt.nested else set(fmt.cameras))
    out = {k: v for k, v in frame.items() if k not in used}
    out[state_key] = _joined([frame[k] for k in fmt.state], fmt.state)
    present = [c for c in fmt.cameras if c in source]
    unknown = sorted(set(source) - set(fmt.cameras)) if fmt.nested else []
    if unknown:
        raise ValueError(f"unknown cameras {unknown} in {fmt.nested!r}; openpi's {name!r} format names "
                         f"{list(fmt.cameras)}")
    for policy_camera, client_camera in zip(cameras, present):
        out[policy_camera] = source[client_camera]
    return out


def _joined(parts: list[Any], keys: tuple[str, ...]) -> Any:
    """The state parts as one float vector (a scalar part is one number); one part passes as it is."""
    if len(parts) == 1:
        return parts[0]
    try:
        return torch.cat([torch.as_tensor(np.asarray(p, dtype=np.float32)).reshape(-1) for p in parts])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the state parts {list(keys)} must be arrays of numbers") from exc
