"""Reading and checking a LeRobot `pretrained_model` folder, before any rank starts.

    folder = PolicyFolder.open({"model": "ckpt/pretrained_model", "vlm": "ckpt/smolvlm"})
    folder.config["type"]          # "smolvla"
    folder.stats["action"]         # {"q01": tensor, "q99": tensor, ...} from the postprocessor's file
    folder.norm_modes["ACTION"]    # "QUANTILES"

A folder holds what LeRobot's `save_pretrained` writes:

    config.json                    "type" (smolvla, pi0, pi05), input_features / output_features,
                                   normalization_mapping, chunk_size, max_state_dim, ...
    model.safetensors              the policy's weights under LeRobot's parameter names
    policy_preprocessor.json       the pipeline steps; the normalizer step names its state file
    policy_postprocessor.json      the unnormalizer step and its state file
    *_normalizer_processor.safetensors / *_unnormalizer_processor.safetensors
                                   the statistics, "<feature>.<stat>" -> tensor

The backbone's config and tokenizer come from LOCAL folders only: plugin_args["vlm"] (SmolVLA's
`vlm_model_name`) or plugin_args["tokenizer"] (pi0's PaliGemma tokenizer); a config that names a
hub model and no local folder given is refused with the folder to give. Nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

SUPPORTED_TYPES = ("smolvla", "pi0", "pi05")
SUPPORTED_NORMS = ("IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10")
REQUIRED_FILES = ("config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json")


class PolicyFolderError(ValueError):
    """A LeRobot policy folder that cannot be served: the message names the file and what to do."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PolicyFolderError(f"lerobot_policy: cannot read {path}: {exc}") from exc


def _step_stats(folder: Path, pipeline: dict[str, Any], name: str) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """The statistics of a pipeline's (un)normalizer step: {feature: {stat: tensor}} and its eps."""
    for step in pipeline.get("steps", []):
        if step.get("registry_name") in ("normalizer_processor", "unnormalizer_processor"):
            state_file = step.get("state_file")
            eps = float(step.get("config", {}).get("eps", 1e-8))
            if not state_file:
                return {}, eps
            path = folder / state_file
            if not path.is_file():
                raise PolicyFolderError(f"lerobot_policy: {name} names the statistics file {state_file}, "
                                        f"which is not in {folder}; copy it from the checkpoint")
            stats: dict[str, dict[str, torch.Tensor]] = {}
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    feature, _, stat = key.rpartition(".")
                    stats.setdefault(feature, {})[stat] = f.get_tensor(key).to(torch.float32)
            return stats, eps
    return {}, 1e-8


def local_folder(value: Any, what: str, arg: str, files: tuple[str, ...]) -> Path:
    """A local folder holding `files`, or a PolicyFolderError saying which folder to give."""
    path = Path(str(value)).expanduser()
    if not path.is_dir():
        raise PolicyFolderError(
            f"lerobot_policy: {what} is {value!r}, which is not a local folder, and nothing is downloaded: "
            f"give plugin_args[{arg!r}] = a local folder with {', '.join(files)} (e.g. a snapshot of {value!r})")
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise PolicyFolderError(f"lerobot_policy: the {what} folder {path} lacks {missing}; "
                                f"it needs {', '.join(files)}")
    return path


@dataclass
class PolicyFolder:
    """A checked `pretrained_model` folder: its config, statistics and backbone folders."""

    path: Path
    config: dict[str, Any]
    stats: dict[str, dict[str, torch.Tensor]]
    eps: float
    norm_modes: dict[str, str]
    backbone: Path
    sizes: dict[str, Any] = field(default_factory=dict)

    @property
    def type(self) -> str:
        return self.config["type"]

    @classmethod
    def open(cls, args: dict[str, Any]) -> "PolicyFolder":
        model = args.get("model")
        if not model:
            raise PolicyFolderError('lerobot_policy needs plugin_args["model"]: a LeRobot pretrained_model folder '
                                    f"({', '.join(REQUIRED_FILES)}, the normalizer .safetensors)")
        path = Path(str(model)).expanduser()
        if not path.is_dir():
            raise PolicyFolderError(
                f"lerobot_policy: model={model!r} is not a local folder, and nothing is downloaded: give the "
                "pretrained_model folder of a checkpoint (e.g. huggingface-cli download lerobot/smolvla_base "
                "--local-dir ckpt, then model='ckpt')")
        missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
        if missing:
            raise PolicyFolderError(f"lerobot_policy: {path} lacks {missing}; a pretrained_model folder has "
                                    f"{', '.join(REQUIRED_FILES)} and the normalizer .safetensors")
        config = _read_json(path / "config.json")
        kind = config.get("type")
        if kind not in SUPPORTED_TYPES:
            raise PolicyFolderError(f"lerobot_policy: {path / 'config.json'} has type={kind!r}; "
                                    f"supported policy types: {', '.join(SUPPORTED_TYPES)}")
        modes = {k: str(v) for k, v in (config.get("normalization_mapping") or {}).items()}
        bad = {k: v for k, v in modes.items() if v not in SUPPORTED_NORMS}
        if bad:
            raise PolicyFolderError(f"lerobot_policy: {path / 'config.json'} normalization_mapping {bad} is not "
                                    f"supported; supported modes: {', '.join(SUPPORTED_NORMS)}")
        stats, eps = _step_stats(path, _read_json(path / "policy_preprocessor.json"), "policy_preprocessor.json")
        post, _ = _step_stats(path, _read_json(path / "policy_postprocessor.json"), "policy_postprocessor.json")
        for feature, values in post.items():
            stats.setdefault(feature, values)
        backbone = cls._backbone(config, args)
        return cls(path, config, stats, eps, modes, backbone, dict(args.get("sizes") or {}))

    @staticmethod
    def _backbone(config: dict[str, Any], args: dict[str, Any]) -> Path:
        if config["type"] == "smolvla":
            name = args.get("vlm") or config.get("vlm_model_name")
            return local_folder(name, "SmolVLA's vlm_model_name", "vlm", ("config.json", "tokenizer_config.json"))
        name = args.get("tokenizer") or "google/paligemma-3b-pt-224"
        return local_folder(name, f"{config['type']}'s PaliGemma tokenizer", "tokenizer", ("tokenizer_config.json",))

    def features(self, kind: str) -> dict[str, tuple[int, ...]]:
        """{key: shape} of the config's input features of one type (VISUAL, STATE) or output ACTION.

        pi0 / pi0.5's `empty_cameras` placeholders (observation.images.empty_camera_<i>) are left out:
        LeRobot feeds them as masked -1 images, which changes no number (its chunks are the same as
        without them), and no robot sends them."""
        table = self.config.get("output_features" if kind == "ACTION" else "input_features") or {}
        out = {k: tuple(v.get("shape", ())) for k, v in table.items() if v.get("type") == kind}
        if kind == "VISUAL" and self.type in ("pi0", "pi05"):
            empty = {f"observation.images.empty_camera_{i}" for i in range(int(self.config.get("empty_cameras", 0)))}
            out = {k: v for k, v in out.items() if k not in empty}
        return out

    def check_weights(self, expected: dict[str, torch.Size], aliases: dict[str, str] | None = None) -> None:
        """model.safetensors against the parameter shapes the model code expects, named when they differ;
        `aliases` {name: other name}: a tied tensor the file may hold under the other name instead."""
        path = self.path / "model.safetensors"
        with safe_open(str(path), "pt") as f:
            have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        for name, other in (aliases or {}).items():
            if name not in have and other in have:
                have[name] = have[other]
        missing = sorted(set(expected) - set(have))
        if missing:
            raise PolicyFolderError(f"lerobot_policy: {path} lacks {len(missing)} tensors the {self.type} model "
                                    f"needs, e.g. {missing[:5]}; is this a {self.type} checkpoint?")
        wrong = [(k, have[k], tuple(s)) for k, s in expected.items() if have[k] != tuple(s)]
        if wrong:
            shown = "; ".join(f"{k}: file {a}, model {b}" for k, a, b in wrong[:5])
            raise PolicyFolderError(f"lerobot_policy: {len(wrong)} tensors of {path} disagree with the config's "
                                    f"sizes ({shown}); check config.json and the backbone folder")

    def load_weights(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The tensors of model.safetensors whose names start with `prefix`, the prefix removed."""
        out = {}
        with safe_open(str(self.path / "model.safetensors"), "pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    out[key[len(prefix):]] = f.get_tensor(key)
        return out
