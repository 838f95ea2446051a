"""A LeRobot checkpoint's robot frames: the one frame format (phyai_ray/stepwise/frames.py) laid out
by the checkpoint's features.

    {"observation.state": float [state_dim],                   the checkpoint's input feature names
     "observation.images.top": uint8 HWC or float CHW in [0, 1],  every camera the checkpoint names
     "task": "pick up the cube",                               (or "prompt"; "" when absent)
     "noise": float32 [chunk_size, max_action_dim],            optional: the initial noise (parity hook)
     "noise_seed": int,                                        optional: the noise drawn from it
     "prev_actions": float [k, action_dim], "inference_delay": d, "execution_horizon": s}   optional RTC

`prev_actions` are in the space of the returned actions (the robot's units); policy.py normalizes
them like LeRobot's actions before guiding, with LeRobot's own guidance (phyai_ray/stepwise/rtc.py,
`RTCRule.lerobot`). openpi-client frames are renamed by `plugin_args["openpi_keys"]` (default:
"observation/image" -> the first camera, "observation/wrist_image" -> the second,
"observation/state" -> the state feature, "prompt" -> "task"). Without `noise` and `noise_seed` the
seed is derived from the state, the task and `step`, so a frame sent again gets the same chunk.
"""

from __future__ import annotations

from typing import Any

from phyai_ray.models.lerobot_policy.folder import PolicyFolder
from phyai_ray.stepwise.formats import check_format
from phyai_ray.stepwise.frames import FrameLayout, openpi_aliases


def frame_layout(folder: PolicyFolder, openpi_keys: dict[str, str] | None,
                 openpi_format: str | None = None) -> FrameLayout:
    """The frames of `folder`'s checkpoint: its one state feature, its cameras, its action chunk; openpi's
    client formats (phyai_ray/stepwise/formats.py) detected from the keys unless `openpi_format` names
    one, or openpi_keys are given (then the frames are taken by those names only)."""
    check_format(openpi_format, "lerobot_policy")
    if openpi_format is None:
        openpi_format = "auto" if openpi_keys is None else "lerobot"
    cfg = folder.config
    [(state_key, state_shape)] = folder.features("STATE").items()
    [action_shape] = folder.features("ACTION").values()
    cameras: dict[str, Any] = folder.features("VISUAL")
    return FrameLayout(state_dim=state_shape[0], action_dim=action_shape[0], chunk=int(cfg["chunk_size"]),
                       state_key=state_key, cameras=cameras, noise_dim=int(cfg["max_action_dim"]),
                       aliases=openpi_aliases(list(cameras), state_key, openpi_keys, "lerobot_policy"),
                       openpi_format=openpi_format)
