"""LeRobot's pre- and postprocessing of one robot frame, as its saved pipelines do it.

    norm = Normalizer(folder)                 # the statistics and modes of the folder
    state = norm.apply(state, "observation.state", "STATE")          # (x - mean) / (std + eps), ...
    actions = norm.apply(actions, "action", "ACTION", inverse=True)  # back to the robot's units
    image = resize_with_pad(image, 512, 512)  # bilinear, aspect kept, padded on the left and top
    tokens = PromptTokenizer(folder.backbone, max_length=48)("pick up the cube")  # "\\n" appended first

Images arrive as float CHW in [0, 1] (a uint8 HWC camera frame, openpi's, is scaled and moved to CHW
when the frame is parsed: phyai_ray/stepwise/fields.py). SigLIP then sees image * 2 - 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from phyai_ray.models.lerobot_policy.folder import PolicyFolder


class Normalizer:
    """LeRobot's NormalizerProcessorStep / UnnormalizerProcessorStep for the folder's features."""

    def __init__(self, folder: PolicyFolder) -> None:
        self.stats, self.eps, self.modes = folder.stats, folder.eps, folder.norm_modes

    def check(self, key: str, kind: str) -> None:
        """Fail now (not per frame) when a mode needs statistics the folder lacks."""
        mode = self.modes.get(kind, "IDENTITY")
        need = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
                "QUANTILE10": ("q10", "q90")}.get(mode, ())
        have = self.stats.get(key, {})
        if need and key in self.stats and not all(n in have for n in need):
            raise ValueError(f"lerobot_policy: {kind} normalization {mode} of {key!r} needs the statistics "
                             f"{need}, the folder's normalizer file has {sorted(have)}")

    def apply(self, x: torch.Tensor, key: str, kind: str, inverse: bool = False) -> torch.Tensor:
        mode = self.modes.get(kind, "IDENTITY")
        stats = self.stats.get(key)
        if mode == "IDENTITY" or stats is None:  # LeRobot leaves a feature without statistics as it is
            return x
        s = {k: v.to(device=x.device, dtype=x.dtype) for k, v in stats.items()}
        if mode == "MEAN_STD":
            return x * s["std"] + s["mean"] if inverse else (x - s["mean"]) / (s["std"] + self.eps)
        low, high = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}[mode]
        denom = s[high] - s[low]
        denom = torch.where(denom == 0, torch.tensor(self.eps, device=x.device, dtype=x.dtype), denom)
        if inverse:
            return (x + 1.0) * denom / 2.0 + s[low]
        return 2.0 * (x - s[low]) / denom - 1.0


def resize_with_pad(img: torch.Tensor, width: int, height: int, pad_value: float = 0.0) -> torch.Tensor:
    """[B, C, H, W] resized (bilinear) to fit width x height with its aspect ratio, padded on the left/top."""
    cur_h, cur_w = img.shape[2:]
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    out = F.interpolate(img, size=(new_h, new_w), mode="bilinear", align_corners=False)
    return F.pad(out, (max(0, int(width - new_w)), 0, max(0, int(height - new_h)), 0), value=pad_value)


def resize_with_pad_centered(img: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """openpi's resize for pi0 / pi0.5: [B, C, H, W] in [0, 1] resized (bilinear, clamped to [-1, 1]) and
    padded with -1 evenly on both sides; an image already height x width is left as it is."""
    cur_h, cur_w = img.shape[2:]
    if (cur_h, cur_w) == (height, width):
        return img
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    out = F.interpolate(img, size=(new_h, new_w), mode="bilinear", align_corners=False).clamp(-1.0, 1.0)
    top, rem_h = divmod(height - new_h, 2)
    left, rem_w = divmod(width - new_w, 2)
    return F.pad(out, (left, left + rem_w, top, top + rem_h), mode="constant", value=-1.0)


def pad_vector(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The last dimension zero-padded to `dim` (LeRobot's pad_vector)."""
    if x.shape[-1] == dim:
        return x
    out = torch.zeros(*x.shape[:-1], dim, dtype=x.dtype, device=x.device)
    out[..., :x.shape[-1]] = x
    return out


class PromptTokenizer:
    """The task string as LeRobot tokenizes it: a newline appended when missing, truncated to
    `max_length`, one frame alone (no padding: frames are stacked with pad masks later)."""

    def __init__(self, folder: Path, max_length: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.max_length = max_length

    def __call__(self, task: str, newline: bool = True) -> torch.Tensor:
        if newline and not task.endswith("\n"):
            task = f"{task}\n"
        out = self.tokenizer(task, max_length=self.max_length, truncation=True, padding="longest",
                             padding_side="right", return_tensors="pt")
        ids, mask = out["input_ids"][0], out["attention_mask"][0].bool()
        return ids[mask]
