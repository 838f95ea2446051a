"""`PipelineModel`: one rank of `diffusers_pipeline`, the iteration protocol over a family's step loop.

    admit(seq, request)   family.begin: the latents drawn, a scheduler copy (cheap, every rank)
    iterate()             ONE denoising step of every running request: the requests whose latents
                          share a shape go through family.step together (one forward per expert);
                          each reports its progress {"step": i, "of": n}. The ones admitted in this
                          plan are encoded together on the encode stage while the others step, then
                          take their first step. A request whose last step this was leaves the
                          denoising set: with its latents at once, or its video once the decode stage
                          made it (a later iterate), in Delta.value with stop_reason "completed"; one
                          whose own encode or decode failed, with Delta.error (stop_reason "error")
    drop(seq)             forget it; recompute(seq): start it again from its noise (new weights)

Stages (stages.py): the encode stage and the decode stage are threads of their own (and CUDA
streams), so the loop's thread runs only transformer steps. On a replica of several ranks the encode
stage runs on ONE rank (the output rank, encode_rank.py; every rank for a family that names no
encoded tensors, Cosmos3): in the iteration that admitted the new jobs, it encodes them while the
running jobs step, then every rank receives each new job's status and tensors from it over the
world group, on the loop's thread, before the new jobs step; so the ranks agree which jobs step and
only the encoding rank holds the text and image encoders. Only the output rank decodes (its results
alone are read; the other ranks' jobs leave at their last step).

The components are diffusers' and transformers' own classes, loaded from the folder with
`from_pretrained` (the class the folder's model_index.json names); the loop, the batching and
the CFG split are ours. Weight updates go by diffusers' own names: `transformer.blocks.0.attn1.
to_q.weight` is `named_parameters()` of the `transformer` component, prefixed by its name.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Any

import torch

from phyai_ray.models.diffusers_pipeline.encode_rank import EncodeRank
from phyai_ray.models.diffusers_pipeline.family import Branches, Family, Job
from phyai_ray.models.diffusers_pipeline.loading import TRAINABLE, SleepState, load_components, materialize
from phyai_ray.models.diffusers_pipeline.stages import PendingDecode, StageWork, video_result
from phyai_ray.plugins.iteration import Delta, Deltas
from phyai_ray.stepwise.schedulers import leave_cohort, part_cohort
from phyai_ray.stepwise.sequence import Running

logger = logging.getLogger(__name__)


def family_class(path: str) -> type[Family]:
    """'module:Class' -> the Family subclass."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


class PipelineModel:
    """One rank: the components, the family's loop, the running jobs (see the module docstring)."""

    def __init__(self, folder: Any, dtypes: dict[str, torch.dtype], ctx: Any) -> None:
        """Components loaded (transformers empty), the family built, the transformers sharded while
        empty, then only this rank's slices read from the files (loading.py)."""
        self.ctx, self.folder = ctx, folder
        cls = family_class(folder.spec.family)
        self.encoder = EncodeRank(cls.encoded, ctx)  # where the encode stage runs (and the encoders live)
        self.components = load_components(folder, ctx, dtypes, self.encoder.here)
        branches = Branches(ctx.group_rank("cfg"), ctx.group_size("cfg"))
        dtype = dtypes["transformer"]
        self.family = cls(self.components, folder.index, branches, ctx.device, dtype)
        if self.encoder.shared:  # it encodes every branch for the replica
            self.family.encoding = Branches()
        self.full_shapes = {f"{name}.{key}": tuple(p.shape) for name in TRAINABLE if name in self.components
                            for key, p in self.components[name].state_dict().items()}
        self.family.parallelize(ctx)
        materialize(self.components, folder, self.family, ctx)
        self.memory = SleepState(self.components, ctx.device)
        self.jobs: Running[Job] = Running()  # the denoising set (and the ones admitted in this plan)
        self._stages: StageWork | None = None  # the encode and decode stages (stages.py)
        self._failed: dict[int, BaseException] = {}  # jobs whose own stage failed in this iteration
        self.weight_version: Any = None
        logger.info("diffusers_pipeline rank %d: %s from %s, cfg rank %d of %d, %s, encodes %s", ctx.rank,
                    folder.class_name, folder.path, branches.cfg_rank, branches.cfg_size, dtype, self.encoder.where)

    def step(self, request: Any) -> dict[str, Any] | None:
        """One whole (checked) request alone, on the caller's thread: its encode, every step, its decode."""
        payload = request.to_payload() if hasattr(request, "to_payload") else dict(request)
        job = self.family.begin(payload)
        failed: dict[int, BaseException] = {}
        if self.encoder.here:
            try:
                self.family.encode([job])
            except Exception as exc:  # noqa: BLE001 - every rank of the replica raises for it (share)
                failed[id(job)] = exc
        failed = self.encoder.share([job], failed)
        if failed:
            raise failed[id(job)]
        self.family.join([job])
        while not job.done:
            self.family.step([job])
        if not self.ctx.is_output_rank:
            return None
        result = self._result(job)
        if isinstance(result, PendingDecode):
            result = video_result(result.base, self.family.decode(job).cpu())
        return result

    # -- the iteration protocol -------------------------------------------------------------------
    @property
    def stages(self) -> StageWork:
        """The encode and decode stages of the loop (stages.py), started with the first admission."""
        if self._stages is None:
            self._stages = StageWork(self.family, self.ctx.device)
        return self._stages

    def admit(self, ident: int, payload: dict[str, Any]) -> None:
        """Its latents and scheduler now; its encode starts with the iteration (`_step`)."""
        self.jobs.admit(ident, self.family.begin(payload))

    def drop(self, ident: int) -> None:
        leave_cohort(self.jobs.drop(ident))
        if self._stages is not None:
            self._stages.forget(ident)

    def pause_sequence(self, ident: int) -> None:
        """Turns (IterationPlan.pause): it sits out the next steps, its latents kept (out of its cohort)."""
        if ident not in self.jobs:  # its latents are final, its decode runs on the decode stage: nothing to pause
            return
        part_cohort(self.jobs[ident])
        self.jobs.pause(ident)

    def resume_sequence(self, ident: int) -> None:
        self.jobs.resume(ident)

    def recompute(self, ident: int) -> None:
        """Start the request again from its noise: the transformer changed under it."""
        if ident in self.jobs:
            job = self.jobs.drop(ident)
            leave_cohort(job)
            self.jobs.admit(ident, self.family.begin(job.request))

    @torch.no_grad()
    def iterate(self) -> dict[int, Delta]:
        """ONE denoising step of every running request (the ones admitted in this plan after their
        encode); a request whose last step this was leaves the denoising set, with its result, or for a
        video once its decode is done (a later iterate); a request whose own stage failed, with its error."""
        stages, start = self.stages, time.perf_counter()
        stepping = bool(len(self.jobs))  # else only decodes are collected: not the loop's pace (Deltas.stepped)
        out = self.jobs.iterate(self._step, self._result, progress=True) if stepping else {}
        for ident, delta in out.items():
            if isinstance(delta.value, PendingDecode):  # latents final: the output rank decodes it on the stage
                stages.start_decode(ident, delta.value.job, delta.value.base)
                out[ident] = Delta(progress=delta.progress)
        out.update({ident: Delta(stop_reason="error", error=exc) for ident, exc in self._failed.items()})
        self._failed = {}
        for ident, (result, error) in stages.finished(wait=not out).items():
            out[ident] = Delta(stop_reason="completed", value=result) if error is None else \
                Delta(stop_reason="error", error=error)
        stages.log.append(("iterate", None, threading.current_thread().name, start, time.perf_counter()))
        return Deltas(out, stepped=stepping, forward_s=getattr(out, "forward_s", None))

    def _step(self, running: list[Job]) -> None:
        """The jobs admitted since the last step start their encode on the encode stage (of the encoding
        rank) while the others take their step; then every rank gets their encode (`EncodeRank.share`),
        they join (together) and take their first step; jobs whose latents share a shape step in one
        family.step."""
        joined = self.jobs.joined()
        pending = self.stages.start_encode(joined) if joined and self.encoder.here else None
        new = {id(job) for job in joined}
        self._step_groups([job for job in running if id(job) not in new])
        if not joined:
            return
        failed = self.stages.encoded(joined, pending) if pending is not None else {}
        failed = self.encoder.share(joined, failed)  # the loop's thread, after the step's collectives
        if failed:
            for ident in [i for i in self.jobs if id(self.jobs[i]) in failed]:
                self._failed[ident] = failed[id(self.jobs.drop(ident))]
        ready = [job for job in joined if id(job) not in failed]
        self.family.join(ready)
        self._step_groups(ready)

    def stage_log(self) -> list[tuple]:
        """(what, ident, thread, start, end) of the latest decodes and iterations on this rank (perf_counter
        seconds): what a benchmark or a test reads to see that no iteration waited for a decode."""
        return list(self._stages.log) if self._stages is not None else []

    def _step_groups(self, jobs: list[Job]) -> None:
        groups: dict[tuple[int, ...], list[Job]] = {}
        for job in jobs:
            groups.setdefault(job.group, []).append(job)
        for group in groups.values():
            self.family.step(group)

    def _result(self, job: Job) -> Any:
        """Its result now (latents; or on a rank whose result is not read), else what its decode needs."""
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
        return PendingDecode(job, {**result, "output_type": kind})

    # -- weight updates by diffusers' names ---------------------------------------------------------
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """{"transformer.blocks.0.attn1.to_q.weight": (shape, dtype), ...} of every trainable component."""
        dtypes = {f"{name}.{key}": p.dtype for name in TRAINABLE if name in self.components
                  for key, p in self.components[name].state_dict().items()}
        return {name: (shape, dtypes[name]) for name, shape in self.full_shapes.items() if name in dtypes}

    @torch.no_grad()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy each full tensor into the component parameter of that name (checked before, by weight_specs);
        after sleep(2) the dropped parameters get their storage back here."""
        states = {name: self.components[name].state_dict() for name in TRAINABLE if name in self.components}
        for name, full in weights:
            component, key = name.split(".", 1)
            target = self.memory.refill(name, states[component][key])
            part = self.family.shard_of(name, full, self.ctx)
            target.copy_(part.to(device=target.device, dtype=target.dtype))

    def component_bytes(self) -> dict[str, int]:
        """{component: bytes of its parameters this rank holds}; 0 for one built empty (meta), e.g. on rank 1
        of a TP=2 Wan replica {"transformer": half of it, "text_encoder": 0, "vae": 0}."""
        return {name: sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type != "meta")
                for name, module in self.components.items() if isinstance(module, torch.nn.Module)}

    # -- sleep: memory back to a colocated trainer (loading.py) -----------------------------------------
    def sleep(self, level: int) -> int:
        """Level 1: caches freed, every component's weights moved to the host on CUDA; level 2: the
        transformers' weights dropped too (the next weight update refills them). Bytes freed."""
        if self._stages is not None:  # no decode reads the VAE while its weights move
            self._stages.drain()
        return self.memory.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        """"weights": the components back on the rank's device (dropped ones wait for the update)."""
        self.memory.wake_up(tags)
