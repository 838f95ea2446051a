"""`PipelineModel`: one rank of `diffusers_pipeline`, the iteration protocol over a family's step loop.

    admit(seq, request)   family.start: the prompt encoded once, the latents drawn, a scheduler copy
    iterate()             ONE denoising step of every running request: the requests whose latents
                          share a shape go through family.step together (one forward per expert);
                          each reports its progress {"step": i, "of": n}; a request whose last step
                          this was leaves, decoded by the VAE, with its result in Delta.value and
                          stop_reason "completed" (the running set: phyai_ray/stepwise/sequence.py)
    drop(seq)             forget it; recompute(seq): start it again from its noise (new weights)

The components are diffusers' and transformers' own classes, loaded from the folder with
`from_pretrained` (the class the folder's model_index.json names); the loop, the batching and
the CFG split are ours. Weight updates go by diffusers' own names: `transformer.blocks.0.attn1.
to_q.weight` is `named_parameters()` of the `transformer` component, prefixed by its name.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import torch

from phyai_ray.models.diffusers_pipeline.family import Branches, Family, Job
from phyai_ray.plugins.iteration import Delta
from phyai_ray.stepwise.schedulers import leave_cohort
from phyai_ray.stepwise.sequence import Running

logger = logging.getLogger(__name__)

TRAINABLE = ("transformer", "transformer_2")  # components a weight update may change


def family_class(path: str) -> type[Family]:
    """'module:Class' -> the Family subclass."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def load_components(folder: Any, device: Any, dtype: torch.dtype) -> dict[str, Any]:
    """Every component of the (checked) folder, by the class its model_index.json names."""
    out: dict[str, Any] = {}
    for name in folder.components():
        library, class_name = folder.index[name]
        path = Path(folder.path) / name
        if name in ("tokenizer", "text_tokenizer"):
            from transformers import AutoTokenizer

            out[name] = AutoTokenizer.from_pretrained(path)
            continue
        if name == "image_processor":  # no weights; transformers picks its backend (PIL without torchvision)
            from transformers import AutoImageProcessor

            out[name] = AutoImageProcessor.from_pretrained(path)
            continue
        cls = getattr(importlib.import_module(library), class_name)
        if name == "scheduler":
            out[name] = cls.from_pretrained(path)
        elif library == "transformers":
            out[name] = cls.from_pretrained(path, dtype=dtype).to(device).eval()
        else:
            out[name] = cls.from_pretrained(path, torch_dtype=dtype).to(device).eval()
    if folder.guardrail is not None:  # Cosmos: the safety checker plugin_args names (cosmos.py)
        from phyai_ray.models.diffusers_pipeline.cosmos import load_guardrail

        out["safety_checker"] = load_guardrail(folder.guardrail)
    return out


class PipelineModel:
    """One rank: the components, the family's loop, the running jobs (see the module docstring)."""

    def __init__(self, folder: Any, dtype: torch.dtype, ctx: Any) -> None:
        self.ctx, self.folder = ctx, folder
        self.components = load_components(folder, ctx.device, dtype)
        branches = Branches(ctx.group_rank("cfg"), ctx.group_size("cfg"))
        self.family = family_class(folder.spec.family)(self.components, folder.index, branches, ctx.device, dtype)
        self.full_shapes = {f"{name}.{key}": tuple(p.shape) for name in TRAINABLE if name in self.components
                            for key, p in self.components[name].state_dict().items()}
        self.family.parallelize(ctx)
        self.jobs: Running[Job] = Running()  # the ones admitted since the last iteration `family.join`s together
        self.weight_version: Any = None
        logger.info("diffusers_pipeline rank %d: %s from %s, cfg rank %d of %d, %s", ctx.rank, folder.class_name,
                    folder.path, branches.cfg_rank, branches.cfg_size, dtype)

    def step(self, request: Any) -> dict[str, Any] | None:
        """One whole (checked) request through the same loop, alone: every step, then the result."""
        payload = request.to_payload() if hasattr(request, "to_payload") else dict(request)
        job = self.family.start(payload)
        self.family.join([job])
        while not job.done:
            self.family.step([job])
        return self._result(job) if self.ctx.is_output_rank else None

    # -- the iteration protocol -------------------------------------------------------------------
    def admit(self, ident: int, payload: dict[str, Any]) -> None:
        self.jobs.admit(ident, self.family.start(payload))

    def drop(self, ident: int) -> None:
        leave_cohort(self.jobs.drop(ident))

    def recompute(self, ident: int) -> None:
        """Start the request again from its noise: the transformer changed under it."""
        if ident in self.jobs:
            job = self.jobs.drop(ident)
            leave_cohort(job)
            self.jobs.admit(ident, self.family.start(job.request))

    @torch.no_grad()
    def iterate(self) -> dict[int, Delta]:
        """ONE denoising step of every running request; the ones that finished leave with their result."""
        return self.jobs.iterate(self._step, self._result, progress=True)

    def _step(self, running: list[Job]) -> None:
        """The jobs admitted since the last step join (together), then every job takes one step, the
        ones whose latents share a shape in one family.step."""
        joined = self.jobs.joined()
        if joined:
            self.family.join(joined)
        groups: dict[tuple[int, ...], list[Job]] = {}
        for job in running:
            groups.setdefault(job.group, []).append(job)
        for jobs in groups.values():
            self.family.step(jobs)

    def _result(self, job: Job) -> dict[str, Any]:
        kind = job.request["output_type"]
        result: dict[str, Any] = {"steps": job.steps}
        if self.weight_version is not None:
            result["weight_version"] = self.weight_version
        if self.ctx.is_output_rank:
            result.update(self.family.outputs(job))  # the streams beside the video (Cosmos3: action, sound)
        if kind == "latent":
            result["video"] = job.value[0].detach().cpu()
            return result
        if not self.ctx.is_output_rank:  # only the output rank's result is read: skip the decode elsewhere
            result["video"] = None
            return result
        video = self.family.decode(job).cpu()
        result["video"] = video if kind == "float" else (video * 255).round().to(torch.uint8)
        return result

    # -- weight updates by diffusers' names ---------------------------------------------------------
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """{"transformer.blocks.0.attn1.to_q.weight": (shape, dtype), ...} of every trainable component."""
        dtypes = {f"{name}.{key}": p.dtype for name in TRAINABLE if name in self.components
                  for key, p in self.components[name].state_dict().items()}
        return {name: (shape, dtypes[name]) for name, shape in self.full_shapes.items() if name in dtypes}

    @torch.no_grad()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy each full tensor into the component parameter of that name (checked before, by weight_specs)."""
        states = {name: self.components[name].state_dict() for name in TRAINABLE if name in self.components}
        for name, full in weights:
            component, key = name.split(".", 1)
            target = states[component][key]
            part = self.family.shard_of(name, full, self.ctx)
            target.copy_(part.to(device=target.device, dtype=target.dtype))
