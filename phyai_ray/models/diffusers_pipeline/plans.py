"""Real-size plans without memory: what each rank of a layout holds for a folder, from its configs alone.

    from phyai_ray.models.diffusers_pipeline.plans import plan_folder
    plan = plan_folder("tests/data/real_configs/Wan2.1-T2V-14B")   # config.json files, no weights
    plan.ranks["TP 2"]            # [{"transformer": 14.2e9, "text_encoder": 11.4e9, "vae": 0.5e9}, {"transformer": ...}]
    plan.budget, plan.default_cost                                  # latent tokens x branches per step

Every model is built on the meta device (its class from model_index.json, its config.json: no
memory, no weights); its bytes per rank are counted as the plugin loads it (loading.py): the CUDA
dtypes of `component_dtypes` ("auto": transformers and text encoder bfloat16, VAE float32, the
transformer's `_keep_in_fp32_modules` float32), the transformer's slice per rank from the
family's own `shard_of` (tensor parallel splits heads and FFN units; Ulysses and CFG keep it whole),
the text and image encoders on the encoding rank only (the output rank, for a family that sends
its `encoded` tensors to the other ranks; every rank otherwise), the VAE on the output rank, and on
the encoding ranks when the pipeline encodes conditioning frames with it (`PipelineSpec.vae_encodes`). The budget is the entry's default per-step
budget (two requests of the folder's recommended shape) against the cost of the model's default
request (`DiffusersPipelineEntry.default_budget`, `cost`). scripts/real_size_plans.py prints the
table docs/models/diffusers_pipeline.md quotes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

LAYOUTS = {"TP 2": ("attention_tp", "dense_tp"), "Ulysses 2": ("attention_cp",), "CFG 2": ("cfg",)}  # 2 ranks each
MODELS = ("transformer", "transformer_2", "text_encoder", "image_encoder", "vae")


class PlanContext:
    """A rank of a 2-rank layout, as `shard_of` reads it: `rank` in the groups of the split axis."""

    def __init__(self, groups: tuple[str, ...], rank: int, parallel: Any = None) -> None:
        self.groups, self.rank, self.parallel, self.is_output_rank = groups, rank, parallel, rank == 0

    def group_rank(self, group: str) -> int:
        return self.rank if group in self.groups else 0

    def group_size(self, group: str) -> int:
        return 2 if group in self.groups else 1


@dataclass
class Plan:
    """One folder's plan: bytes per component on each rank of each layout, its CUDA dtypes and budget."""

    name: str
    ranks: dict[str, list[dict[str, int]]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    budget: int = 0
    default_cost: int = 0
    default_shape: tuple[int, int, int] = (0, 0, 0)


def plan_folder(path: Any) -> Plan:
    """The plan of the folder of configs at `path` (see the module docstring)."""
    from phyai_ray.models.diffusers_pipeline.entry import DiffusersPipelineEntry
    from phyai_ray.models.diffusers_pipeline.folder import Folder
    from phyai_ray.models.diffusers_pipeline.loading import component_dtypes
    from phyai_ray.models.diffusers_pipeline.model import family_class
    from phyai_ray.models.diffusers_pipeline.request import VideoRequest

    folder = Folder.open(path, weights=False)
    dtypes = component_dtypes({}, torch.device("cuda"))
    entry = DiffusersPipelineEntry()
    entry.use(folder, {})
    family = family_class(folder.spec.family)
    sizes = {name: _tensors(folder, name, dtypes[name]) for name in MODELS if name in folder.configs}
    plan = Plan(Path(path).name, dtypes={name: str(dtypes[name]).replace("torch.", "") for name in sizes})
    for layout, groups in LAYOUTS.items():
        plan.ranks[layout] = [_rank_bytes(folder, family, sizes, PlanContext(groups, rank)) for rank in (0, 1)]
    default: VideoRequest = entry.validate_request({"prompt": "a robot arm welds metal"})  # within its limits
    plan.budget, plan.default_cost = entry.default_budget(), entry.cost(default)
    plan.default_shape = (default.height, default.width, default.num_frames)
    return plan


def _tensors(folder: Any, name: str, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], int]]:
    """{parameter: (shape, bytes per element)} of component `name` built on the meta device."""
    library, class_name = folder.index[name]
    cls = getattr(importlib.import_module(library), class_name)
    path = Path(folder.path) / name
    if library == "transformers":
        config = cls.config_class.from_pretrained(path)
        with torch.device("meta"):
            model = cls(config)
        keep: list[str] = []
    else:
        from phyai_ray.models.diffusers_pipeline.loading import empty_model

        model = empty_model(cls, path, dtype)
        keep = getattr(cls, "_keep_in_fp32_modules", None) or []
    item = torch.empty((), dtype=dtype).element_size()
    return {key: (tuple(p.shape), 4 if any(k in key.split(".") for k in keep) else item)
            for key, p in model.named_parameters()}


def _rank_bytes(folder: Any, family: Any, sizes: dict[str, Any], ctx: PlanContext) -> dict[str, int]:
    """Bytes per component on the rank `ctx`: the transformers' slices, the rest whole where they live."""
    from phyai_ray.models.diffusers_pipeline.loading import ENCODERS

    out: dict[str, int] = {}
    encodes = ctx.is_output_rank or not family.encoded  # every layout here has two ranks (encode_rank.py)
    for name, tensors in sizes.items():
        if (name == "vae" and not (ctx.is_output_rank or (folder.spec.vae_encodes and encodes))) or \
                (name in ENCODERS and not encodes):
            continue
        total = 0
        for key, (shape, item) in tensors.items():
            if name in ("transformer", "transformer_2"):
                shape = _local_shape(family, f"{name}.{key}", shape, ctx)
            total += item * int(torch.Size(shape).numel())
        out[name] = total
    return out


def _local_shape(family: Any, name: str, full: tuple[int, ...], ctx: PlanContext) -> tuple[int, ...]:
    """The rank's shape of parameter `name`: the family's `shard_of` (which reads no state of the family)
    applied to an expanded view of the full shape (no memory)."""
    view = torch.empty((), dtype=torch.uint8).expand(full)
    return tuple(family.shard_of(None, name, view, ctx).shape)


def table(plans: list[Plan]) -> str:
    """The markdown table docs/models/diffusers_pipeline.md quotes: GiB per rank (rank 0 / rank 1)."""
    gib = 2 ** 30
    rows = ["| model | CUDA dtypes | layout | rank 0 GiB (transformer + text + VAE) | rank 1 GiB | default request "
            "| cost | default budget |", "|---|---|---|---|---|---|---|---|"]
    for plan in plans:
        dtypes = ", ".join(f"{k} {v}" for k, v in plan.dtypes.items())
        for layout, ranks in plan.ranks.items():
            cells = []
            for parts in ranks:
                tf = sum(v for k, v in parts.items() if k.startswith("transformer"))
                cells.append(f"{sum(parts.values()) / gib:.1f} ({tf / gib:.1f} + {parts.get('text_encoder', 0) / gib:.1f}"
                             f" + {parts.get('vae', 0) / gib:.2f})")
            h, w, f = plan.default_shape
            rows.append(f"| {plan.name} | {dtypes} | {layout} | {cells[0]} | {cells[1]} | {h} x {w} x {f} | "
                        f"{plan.default_cost:,} | {plan.budget:,} ({plan.budget / plan.default_cost:.1f} requests) |")
    return "\n".join(rows)
