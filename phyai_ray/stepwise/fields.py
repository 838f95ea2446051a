"""The checks of one robot frame's fields, each refusing with the field's name and what it must be.

    state = floats(frame, "state", (None,), "[8]")            # float32, finite, or ValueError
    delay = bounded_int(frame, "inference_delay", 0, 16)     # None when absent
    image = as_image(camera, "observation.images.top")       # float CHW in [0, 1]

`frames.py` builds the one robot frame format from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

NUMBERS = (torch.int32, torch.int64)  # integer arrays a float field takes (converted to float32)


def tensor(value: Any, key: str) -> torch.Tensor:
    """`value` (a tensor, numpy array or nested list) as a tensor, or ValueError naming `key`."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"'{key}' must be an array of numbers, got {type(value).__name__}") from exc


def bounded_int(frame: dict[str, Any], key: str, low: int, high: int) -> int | None:
    """frame[key] as an int in [low, high] (numpy and 0-d tensor integers too); None when absent."""
    value = frame.get(key)
    if value is None:
        return None
    if isinstance(value, (np.integer, torch.Tensor)) and np.ndim(value) == 0 and \
            not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"'{key}' must be an int in [{low}, {high}], got {value!r}")
    return value


def floats(value: Any, key: str, shape: tuple[int | None, ...], hint: str) -> torch.Tensor:
    """`value` as finite float32 of `shape` (None: any size there); ValueError "'key' must be float {hint}"."""
    t = tensor(value, key)
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)) \
            or not (t.is_floating_point() or t.dtype in NUMBERS):
        raise ValueError(f"'{key}' must be float {hint}, got shape {list(t.shape)} of {t.dtype}")
    return finite(t.to(torch.float32), key)


def finite(t: torch.Tensor, key: str) -> torch.Tensor:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"'{key}' holds NaN or infinite values")
    return t


def as_image(value: Any, key: str) -> torch.Tensor:
    """A camera frame as float CHW in [0, 1]: uint8 (0..255) or float ([0, 1]), HWC or CHW. A 3 on the
    last axis is read as HWC for uint8 (openpi's cameras) and a 3 on the first as CHW for float (LeRobot's),
    when both are 3; otherwise the axis holding the 3 channels says which."""
    if not isinstance(value, (torch.Tensor, np.ndarray)):
        try:
            value = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"'{key}' must be an image array, got {type(value).__name__}") from exc
    value = tensor(value, key)
    if value.dim() != 3:
        raise ValueError(f"'{key}' must be an image with 3 dimensions (float CHW in [0, 1] or uint8 HWC), "
                         f"got shape {list(value.shape)}")
    if value.dtype == torch.uint8:
        value = value.to(torch.float32) / 255.0
        hwc = value.shape[-1] == 3
    elif value.is_floating_point():
        value = value.to(torch.float32)
        hwc = value.shape[0] != 3 and value.shape[-1] == 3
    else:
        raise ValueError(f"'{key}' must be uint8 HWC or float CHW, got {value.dtype}")
    if not hwc and value.shape[0] != 3:
        raise ValueError(f"'{key}': an image is HWC with 3 channels or CHW with 3 channels (uint8 0..255 or "
                         f"float in [0, 1]), got shape {list(value.shape)}")
    return finite(value.permute(2, 0, 1) if hwc else value, key)
