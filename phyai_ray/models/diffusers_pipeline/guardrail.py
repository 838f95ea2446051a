"""`Guardrail`: a safety checker run once per request: the prompt in the dispatcher, the video on the output rank.

    guard = Guardrail.load("tests.diffusers_cosmos:StandInSafetyChecker")   # or a local checkpoint folder
    guard.check_text("a robot arm welds metal")       # None, or GuardrailError (the text is never in it)
    video = guard.check_video(frames)                 # uint8 [F, H, W, 3] -> the checked video, or GuardrailError

The checker is any object with the interface of NVIDIA's `cosmos_guardrail.CosmosSafetyChecker`:
`check_text_safety(prompt) -> bool` and `check_video_safety(uint8 [F, H, W, 3]) -> video`, where a
video of None means refused. plugin_args name it:

    safety_checker            "package.module:Name" (a class is built with safety_checker_args as
                              keyword arguments), or a local folder: NVIDIA's checker built from
                              that checkpoint folder (checkpoint_id=folder)
    safety_checker_args       {} by default
    safety_checker_download   False by default: the checker is built with the Hugging Face hub
                              offline, so it reads local files only; True lets it download

Where it runs (once per request, never per rank): the entry calls `check_text` in
`validate_request` (the dispatcher) before the request is queued; the output rank holds the one
`Guardrail` of its replica (`loading.py`, on the model's device) and its family calls
`check_video` after the VAE decode. A refusal is a `GuardrailError`, a 400 for that request alone.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from phyai_ray.errors import GuardrailError, PhyAIError

NVIDIA = "cosmos_guardrail:CosmosSafetyChecker"
METHODS = ("check_text_safety", "check_video_safety")
__all__ = ["Guardrail", "GuardrailConfigError", "GuardrailError"]  # GuardrailError: phyai_ray/errors.py's


class GuardrailConfigError(PhyAIError, ValueError):
    """plugin_args name no safety checker where one is required, or one that cannot be loaded."""


def checker_spec(plugin_args: dict[str, Any]) -> tuple[Any, dict[str, Any], bool]:
    """(safety_checker, safety_checker_args, safety_checker_download) of plugin_args, checked."""
    spec, args = plugin_args.get("safety_checker"), plugin_args.get("safety_checker_args") or {}
    download = plugin_args.get("safety_checker_download", False)
    if not isinstance(args, dict) or not isinstance(download, bool):
        raise GuardrailConfigError(f"plugin_args['safety_checker_args'] must be a dict and "
                                   f"['safety_checker_download'] a bool, got {args!r} and {download!r}")
    return spec, args, download


def resolve(spec: Any) -> tuple[Any, dict[str, Any]]:
    """What to build for `spec`: (the class or object, extra keyword arguments); imports, builds nothing."""
    if isinstance(spec, (str, Path)) and Path(spec).expanduser().is_dir():
        return _import(NVIDIA, spec), {"checkpoint_id": str(Path(spec).expanduser())}
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise GuardrailConfigError(f"plugin_args['safety_checker'] must be an import path 'package.module:Name' "
                                   f"or a local checkpoint folder, got {spec!r}")
    found = _import(spec, spec)
    missing = [m for m in METHODS if not callable(getattr(found, m, None))]
    if missing:
        raise GuardrailConfigError(f"plugin_args['safety_checker'] = {spec!r} lacks {missing}: it needs "
                                   "check_text_safety(prompt) -> bool and check_video_safety(uint8 [frames, H, "
                                   "W, 3]) -> video (None when refused)")
    return found, {}


def _import(path: str, named: Any) -> Any:
    module, name = path.split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise GuardrailConfigError(f"plugin_args['safety_checker'] = {str(named)!r} needs {path!r}, which cannot "
                                   f"be imported ({exc}); it must be importable where the model runs") from exc


@contextlib.contextmanager
def offline(allowed: bool) -> Iterator[None]:
    """The Hugging Face hub offline (local files only) unless `allowed`: a checker that would download fails."""
    if allowed:
        yield
        return
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = _hub_constants()
    before = getattr(constants, "HF_HUB_OFFLINE", None)
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        if constants is not None:
            constants.HF_HUB_OFFLINE = before
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved


def _hub_constants() -> Any:
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return constants


class Guardrail:
    """One safety checker and the two checks of a request (see the module docstring)."""

    def __init__(self, checker: Any, name: str) -> None:
        self.checker, self.name = checker, name

    @classmethod
    def load(cls, spec: Any, args: dict[str, Any] | None = None, download: bool = False,
             device: Any = None) -> "Guardrail":
        """Build the checker `spec` names (see `resolve`), offline unless `download`, on `device`."""
        found, extra = resolve(spec)
        try:
            with offline(download):
                checker = found(**extra, **(args or {})) if isinstance(found, type) else found
        except Exception as exc:  # its files missing offline, bad arguments: say how to give them
            raise GuardrailConfigError(
                f"plugin_args['safety_checker'] = {str(spec)!r} could not be built ({type(exc).__name__}: {exc}); "
                f"it is built offline unless plugin_args['safety_checker_download'] is True: give a local "
                f"checkpoint folder, its files in the Hugging Face cache, or allow the download") from exc
        return cls(checker, str(spec)).to(device)

    def to(self, device: Any) -> "Guardrail":
        """The checker's weights on `device` (a checker without `to` stays as it is)."""
        if device is not None and callable(getattr(self.checker, "to", None)):
            moved = self.checker.to(device)
            self.checker = self.checker if moved is None else moved
        return self

    def check_text(self, text: str) -> None:
        """Raise GuardrailError when the checker refuses `text`; the message holds its length, not the text."""
        if not self.checker.check_text_safety(text):
            raise GuardrailError(f"the guardrail ({self.name}) refused the prompt (a text of {len(text)} "
                                 "characters, not repeated here); send another prompt", field="prompt")

    def check_video(self, frames: np.ndarray) -> np.ndarray:
        """The checked video (uint8 [F, H, W, 3]; a checker may blur faces), or GuardrailError when refused."""
        checked = self.checker.check_video_safety(frames)
        if checked is None:
            raise GuardrailError(f"the guardrail ({self.name}) refused the generated video ({frames.shape[0]} "
                                 f"frames of {frames.shape[1]} x {frames.shape[2]}); send another prompt or seed")
        return np.asarray(checked)


def required_spec(plugin_args: dict[str, Any], folder: Any, pipeline: str) -> Any:
    """The safety checker a licensed pipeline (Cosmos) must have: plugin_args' or NVIDIA's when installed;
    else a GuardrailConfigError saying why and how (raised in the dispatcher, before any rank)."""
    spec = plugin_args.get("safety_checker")
    if spec is not None:
        return spec
    try:
        importlib.import_module(NVIDIA.split(":")[0])
        return NVIDIA
    except ImportError:
        raise GuardrailConfigError(
            f"{folder}: {pipeline} checkpoints are licensed under the NVIDIA Open Model License, which "
            f"requires the Cosmos guardrail on every prompt and every video, and none is given: plugin_args "
            f"has no 'safety_checker' and the package cosmos_guardrail is not installed. Give one as an import "
            f"path, e.g. plugin_args['safety_checker'] = '{NVIDIA}' (after `pip install cosmos_guardrail`), a "
            f"local checkpoint folder of it, or 'package.module:Name' of your own class with "
            f"check_text_safety(prompt) -> bool and check_video_safety(uint8 [frames, H, W, 3]) -> video") from None
