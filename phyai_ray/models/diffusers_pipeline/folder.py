"""A diffusers pipeline folder, checked before any rank starts (in the Entry, in the dispatcher).

    folder/model_index.json    {"_class_name": "WanPipeline", "transformer": ["diffusers",
                                "WanTransformer3DModel"], ..., "boundary_ratio": 0.875}
    folder/<component>/        config.json (or scheduler_config.json) and *.safetensors

`Folder.open(path)` refuses, naming the file and what is supported:
  * a folder without model_index.json, or a pipeline class no family here serves (`PIPELINES`);
  * a component the class needs that is missing (no folder, or no config in it);
  * a tensor whose shape disagrees with its component's config: the model is built from the config
    on the meta device (no memory, no weights) and every tensor header of the .safetensors files is
    compared with it; and components that disagree with each other (the transformer's in_channels
    vs the VAE's z_dim, its text_dim vs the text encoder's d_model).
Nothing is downloaded: `model` must be a local folder, never a hub name.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phyai_ray.errors import PhyAIError


class PipelineFolderError(PhyAIError, ValueError):
    """A pipeline folder this plugin cannot serve: the message names the file and what is supported."""


@dataclass(frozen=True)
class PipelineSpec:
    """What a pipeline class needs: its family (module:class of a `Family`) and its components."""

    family: str
    required: tuple[str, ...]
    transformers: tuple[str, ...] = ("transformer",)  # at least the first; the rest are optional experts
    mask_channels: int = 0  # transformer in_channels beyond the VAE's z_dim (Cosmos: the condition mask)
    check: str | None = None  # "module:function" refusing layouts of this class not served (after the checks)
    recommended: tuple[int, int, int] = (480, 832, 81)  # (height, width, frames): the pipeline's default request
    vae_encodes: bool = False  # the VAE encodes conditioning frames on every rank (else: only the output rank decodes)
    optional: tuple[str, ...] = ()  # read and checked when the index names them; `check` says when one is needed


PIPELINES: dict[str, PipelineSpec] = {
    "WanPipeline": PipelineSpec("phyai_ray.models.diffusers_pipeline.wan:WanFamily",
                                ("tokenizer", "text_encoder", "vae", "scheduler"),
                                ("transformer", "transformer_2")),
    "Cosmos2_5_PredictBasePipeline": PipelineSpec("phyai_ray.models.diffusers_pipeline.cosmos:CosmosFamily",
                                                  ("tokenizer", "text_encoder", "vae", "scheduler"),
                                                  mask_channels=1, recommended=(704, 1280, 93), vae_encodes=True),
    "WanImageToVideoPipeline": PipelineSpec("phyai_ray.models.diffusers_pipeline.wan_i2v:WanImageToVideoFamily",
                                            ("tokenizer", "text_encoder", "vae", "scheduler"),
                                            ("transformer", "transformer_2"), mask_channels=4 + 16,  # mask + condition
                                            check="phyai_ray.models.diffusers_pipeline.wan_i2v:check_folder",
                                            vae_encodes=True, optional=("image_encoder", "image_processor")),
    "Cosmos3OmniPipeline": PipelineSpec("phyai_ray.models.diffusers_pipeline.cosmos3:Cosmos3Family",
                                        ("text_tokenizer", "vae", "scheduler"), recommended=(720, 1280, 189),
                                        vae_encodes=True, optional=("sound_tokenizer",)),
}

MODEL_COMPONENTS = ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder")  # weights checked against configs


@dataclass
class Folder:
    """A checked pipeline folder: its index, the configs of its components, its pipeline spec."""

    path: Path
    index: dict[str, Any]
    spec: PipelineSpec
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    guardrail: tuple | None = None  # (safety_checker, its args, download allowed): Cosmos; set by the entry (guardrail.py)

    @property
    def class_name(self) -> str:
        return self.index["_class_name"]

    def components(self) -> list[str]:
        """The components present, in the order the index lists them."""
        return [name for name, value in self.index.items()
                if not name.startswith("_") and isinstance(value, list) and value[0] is not None
                and name != "safety_checker"]  # a guardrail is named by plugin_args, never loaded from here

    @classmethod
    def open(cls, model: Any, *, weights: bool = True) -> "Folder":
        """Read and check the folder at `model` (see the module docstring); `weights=False` reads the
        configs only (a folder of config.json files, as plans.py sizes real models without their weights)."""
        if not isinstance(model, (str, Path)) or not str(model):
            raise PipelineFolderError("plugin_args['model'] must be the path of a local diffusers pipeline folder "
                                      f"(holding model_index.json), got {model!r}")
        path = Path(model).expanduser()
        index_file = path / "model_index.json"
        if not index_file.is_file():
            raise PipelineFolderError(
                f"{index_file} does not exist: plugin_args['model'] must be a local diffusers pipeline folder "
                f"(nothing is downloaded; save one with Pipeline.save_pretrained(folder)); supported pipelines: "
                f"{sorted(PIPELINES)}")
        index = json.loads(index_file.read_text())
        name = index.get("_class_name")
        if name not in PIPELINES:
            raise PipelineFolderError(f"{index_file}: pipeline class {name!r} is not supported; supported: "
                                      f"{sorted(PIPELINES)}")
        folder = cls(path, index, PIPELINES[name])
        folder._check_components()
        if weights:
            folder._check_tensors()
        folder._check_agreement()
        if folder.spec.check is not None:
            module, function = folder.spec.check.split(":")
            getattr(importlib.import_module(module), function)(folder)
        return folder

    # -- checks ----------------------------------------------------------------------------------
    def _check_components(self) -> None:
        spec, present = self.spec, set(self.components())
        needed = list(spec.required) + [spec.transformers[0]]
        for name in [n for n in (*spec.transformers[1:], *spec.optional) if n in present] + needed:
            folder = self.path / name
            if name not in present or not folder.is_dir():
                raise PipelineFolderError(
                    f"{self.path / 'model_index.json'}: {self.class_name} needs component {name!r} "
                    f"(a folder {folder}), which is missing; components it needs: {needed}, optional: "
                    f"{[*spec.transformers[1:], *spec.optional]}")
            self.configs[name] = _read_config(folder, name, self.index[name])

    def _check_tensors(self) -> None:
        for name in MODEL_COMPONENTS:
            if name in self.configs:
                _check_shapes(self.path / name, self.index[name], self.configs[name])

    def _check_agreement(self) -> None:
        vae, text = self.configs.get("vae", {}), self.configs.get("text_encoder", {})
        for name in self.spec.transformers:
            config = self.configs.get(name)
            if config is None:
                continue
            where = self.path / name / "config.json"
            extra = self.spec.mask_channels
            channels = config.get("in_channels", config.get("latent_channel"))  # Cosmos3: latent_channel
            if "z_dim" in vae and channels != vae["z_dim"] + extra:
                raise PipelineFolderError(f"{where}: in_channels={channels} disagrees with the "
                                          f"VAE's z_dim={vae['z_dim']}" + (f" + {extra} mask channel" if extra else "")
                                          + f" ({self.path / 'vae' / 'config.json'})")
            if "d_model" in text and config.get("text_dim") not in (None, text["d_model"]):
                raise PipelineFolderError(
                    f"{where}: text_dim={config.get('text_dim')} disagrees with the text encoder's d_model="
                    f"{text['d_model']} ({self.path / 'text_encoder' / 'config.json'})")

    # -- what the entry needs ---------------------------------------------------------------------
    def transformer_config(self) -> dict[str, Any]:
        return self.configs[self.spec.transformers[0]]

    def recommended(self) -> tuple[int, int, int]:
        """(height, width, frames) of the folder's recommended request: its pipeline's defaults, and Wan
        2.2 TI2V's own 704 x 1280 x 121 (a WanPipeline folder with expand_timesteps)."""
        if self.class_name == "WanPipeline" and self.index.get("expand_timesteps"):
            return (704, 1280, 121)
        return self.spec.recommended

    def factors(self) -> tuple[int, int, tuple[int, ...]]:
        """(VAE temporal factor, VAE spatial factor, transformer patch (t, h, w))."""
        vae, tf = self.configs["vae"], self.transformer_config()
        return (int(vae.get("scale_factor_temporal") or 4), int(vae.get("scale_factor_spatial") or 8),
                tuple(int(p) for p in tf.get("patch_size", (1, 2, 2))))

    def positional_range(self) -> tuple[int, int, int]:
        """(frames, height, width) the transformer's positions reach: Wan's rope_max_seq_len patches per
        axis, Cosmos' max_size latent positions per axis (beyond them its forward fails)."""
        temporal, spatial, patch = self.factors()
        tf = self.transformer_config()
        if "max_size" in tf:  # CosmosTransformer3DModel: latent positions (t, h, w)
            t, h, w = (int(n) for n in tf["max_size"])
        else:  # WanTransformer3DModel: rope_max_seq_len positions of patches per axis
            n = int(tf.get("rope_max_seq_len", 1024))
            t, h, w = n * patch[0], n * patch[1], n * patch[2]
        return temporal * (t - 1) + 1, h * spatial, w * spatial

    def step_range(self) -> int:
        """Denoising steps the scheduler was trained over (its num_train_timesteps), else 1000: more steps than
        that only repeat timesteps, and a request asking for 10**9 is refused rather than run."""
        return int(self.configs.get("scheduler", {}).get("num_train_timesteps") or 1000)

    def text_range(self) -> int:
        """The text tokens the text encoder's positions reach (max_position_embeddings), else 512 (diffusers'
        default, what Wan's UMT5 relative positions were trained at)."""
        text = self.configs.get("text_encoder", {})
        found = text.get("max_position_embeddings") or (text.get("text_config") or {}).get("max_position_embeddings")
        return int(found or 512)


def _read_config(folder: Path, name: str, entry: list) -> dict[str, Any]:
    for file in ("config.json", "scheduler_config.json", "tokenizer_config.json", "preprocessor_config.json"):
        if (folder / file).is_file():
            return json.loads((folder / file).read_text())
    raise PipelineFolderError(f"{folder}: component {name!r} ({entry[0]}.{entry[1]}) has no config.json, "
                              "scheduler_config.json, tokenizer_config.json or preprocessor_config.json; save it with save_pretrained")


def _check_shapes(folder: Path, entry: list, config: dict[str, Any]) -> None:
    """Every tensor in folder/*.safetensors against the model built from its config on the meta device."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise PipelineFolderError(f"{folder}: no .safetensors weights (component {entry[1]}); save the pipeline "
                                  "with save_pretrained(safe_serialization=True)")
    expected, rename = _expected_shapes(entry, folder)
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                want = expected.get(key, expected.get(rename(key)))
                if want is None:
                    raise PipelineFolderError(f"{file}: tensor {key!r} is not a parameter of {entry[1]} as its "
                                              f"config.json describes it; the weights and config disagree")
                if want != shape:
                    raise PipelineFolderError(f"{file}: tensor {key!r} has shape {list(shape)}, but {entry[1]} "
                                              f"built from {folder / 'config.json'} expects {list(want)}")


def _expected_shapes(entry: list, folder: Path) -> tuple[dict[str, tuple[int, ...]], Any]:
    """{name: shape} of the model class `entry` ([library, class]) built from its config, without memory,
    and the renaming of a saved tensor name to the model's (transformers renames some on load)."""
    import torch
    from accelerate import init_empty_weights

    library, class_name = entry
    cls = getattr(importlib.import_module(library), class_name)
    with init_empty_weights(), torch.device("meta"):
        if library == "transformers":
            from transformers import AutoConfig

            model = cls(AutoConfig.from_pretrained(folder))
        else:
            model = cls.from_config(cls.load_config(folder))
    state = model.state_dict()
    rename = _checkpoint_renaming(model, state) if library == "transformers" else (lambda key: key)
    return {k: tuple(v.shape) for k, v in state.items()}, rename


def _checkpoint_renaming(model: Any, state: dict[str, Any]) -> Any:
    """Saved tensor name -> module name as transformers maps it on load: Qwen2.5-VL (Cosmos' text encoder)
    saves 'model.layers.0...' for the module's 'model.language_model.layers.0...'."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # transformers 4.x keeps saved names equal to module names here
        return lambda key: key
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    return lambda key: rename_source_key(key, renamings, converters, model.base_model_prefix, state)[0]
