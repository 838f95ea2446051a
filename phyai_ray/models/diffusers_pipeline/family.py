"""`Family`: the model-family side of the denoising step loop (Wan, Cosmos, ...).

The per-rank model (`model.py`) owns the loop and knows nothing of any family:

    job = family.start(request)         admission: draw the latents as the diffusers pipeline does for
                                        one prompt, a deep copy of the scheduler with its timesteps set
                                        (a family may encode the prompt here, once)
    family.join(jobs)                   the jobs admitted since the last step, together: a family may
                                        encode their prompts in one call (Wan does); jobs with one
                                        schedule and latent shape form a `Cohort` (below)
    family.step(jobs)                   ONE denoising step of every job in `jobs` (they share a latent
                                        shape, `job.group`): the rows of every job stacked into one
                                        transformer forward per guidance branch (and expert), then
                                        each job's own scheduler.step; advances job.i
    family.decode(job)                  -> float video [frames, H, W, 3] in [0, 1] (the VAE), after the
                                        last step (`job.done`)

A `Cohort` is what diffusers' own N-prompt call does with its one scheduler: jobs that joined together
with the same step count and latent shape share ONE scheduler instance over their stacked rows, so each
step is one `scheduler.step` for the cohort instead of one per job (8 UniPC steps cost 9 ms for one row
and 11.5 ms for 8 rows on a 2-core CPU). The schedulers' math is row-wise, so a row equals what its
own scheduler gives. A member that leaves early (dropped, restarted) takes its rows out of the shared
state (`Cohort.remove`); the others go on.

A family module (`wan.py`, `cosmos.py`) subclasses `Family` and is named in `folder.PIPELINES` by
the pipeline class of the folder's model_index.json; `parallelize(ctx)` shards its transformers
and `shard_of` cuts a weight update's full tensor to this rank's part. Every rank of a replica runs the same
calls in the same order; collectives (the CFG gather) happen inside `step`. `Branches` says which
guidance branches this rank computes: all of them on one rank, or cond on cfg rank 0 and uncond
on cfg rank 1 (`outer.cfg_size=2`), gathered with `Branches.gather`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)  # a job is itself: compared (and found in lists) by identity, never by its tensors
class Job:
    """One request on its way through the step loop (every rank holds the same jobs)."""

    request: Any  # the parsed request (request.py)
    latents: torch.Tensor  # [1, C, F, h, w] float32, as the pipeline keeps them
    scheduler: Any  # this job's own copy: schedulers keep per-instance state (step index, history)
    timesteps: torch.Tensor  # the scheduler's timesteps for this job's step count
    cond: dict[str, Any] = field(default_factory=dict)  # family-specific conditioning (embeddings, ...)
    i: int = 0  # steps taken
    cohort: "Cohort | None" = None  # the jobs it shares a scheduler with (None: its own)

    @property
    def steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.i >= self.steps

    @property
    def group(self) -> tuple[int, ...]:
        """Jobs whose latents share this shape are stacked into one forward."""
        return tuple(self.latents.shape)


class Cohort:
    """Jobs that share ONE scheduler over their stacked rows (see the module docstring)."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = list(jobs)
        self.scheduler = jobs[0].scheduler
        for job in jobs:
            job.cohort, job.scheduler = self, self.scheduler

    def remove(self, job: Job) -> None:
        """`job` leaves before the others: its rows leave every per-row tensor of the shared state."""
        k = self.jobs.index(job)
        keep = torch.tensor([j for j in range(len(self.jobs)) if j != k])
        rows, ndim = len(self.jobs), job.latents.ndim
        for name, value in list(vars(self.scheduler).items()):
            taken = _take_rows(value, keep, rows, ndim)
            if taken is not value:
                setattr(self.scheduler, name, taken)
        del self.jobs[k]
        job.cohort = None

    def step(self, noise: dict[int, torch.Tensor]) -> None:
        """One scheduler step of every member (`noise[id(job)]` its guided prediction, [1, ...])."""
        jobs = self.jobs
        latents = torch.cat([job.latents for job in jobs])
        out = self.scheduler.step(torch.cat([noise[id(job)] for job in jobs]), jobs[0].timesteps[jobs[0].i],
                                  latents, return_dict=False)[0]
        for k, job in enumerate(jobs):
            job.latents = out[k:k + 1]
            job.i += 1


def _take_rows(value: Any, keep: torch.Tensor, rows: int, ndim: int) -> Any:
    """`value` with only the rows `keep` when it is per-row state (a latent-shaped tensor of `rows` rows,
    or a list / tuple of such); anything else (the schedule's arrays, scalars) unchanged."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, keep.to(value.device)) if value.ndim == ndim and value.shape[0] == rows else value
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_take_rows(v, keep, rows, ndim) for v in value)
    return value


def form_cohorts(jobs: list[Job]) -> None:
    """Jobs that joined together with one step count and latent shape become one cohort each."""
    groups: dict[tuple, list[Job]] = {}
    for job in jobs:
        groups.setdefault((job.steps, tuple(job.latents.shape)), []).append(job)
    for members in groups.values():
        if len(members) > 1:
            Cohort(members)


def advance(jobs: list[Job], noise: dict[int, torch.Tensor]) -> None:
    """The scheduler step of every job in `jobs` (`noise[id(job)]`: its guided prediction): a cohort's
    members in one call, the others each on its own scheduler."""
    stepped: set[int] = set()
    for job in jobs:
        if job.cohort is None:
            job.latents = job.scheduler.step(noise[id(job)], job.timesteps[job.i], job.latents, return_dict=False)[0]
            job.i += 1
        elif id(job.cohort) not in stepped:
            stepped.add(id(job.cohort))
            job.cohort.step(noise)


@dataclass(frozen=True)
class Branches:
    """Which classifier-free-guidance branches this rank computes (cfg group of size 1 or 2)."""

    cfg_rank: int = 0
    cfg_size: int = 1

    @property
    def cond(self) -> bool:
        return self.cfg_rank == 0

    @property
    def uncond(self) -> bool:
        return self.cfg_size == 1 or self.cfg_rank == 1

    def gather(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cond, uncond) predictions for every row from this rank's `local` ([2, rows, ...] on one
        rank; [rows, ...] of its own branch over cfg 2, gathered over group "cfg")."""
        if self.cfg_size == 1:
            return local[0], local[1]
        from phyai_ray.collectives import P

        both = P.all_gather(local.unsqueeze(0).contiguous(), "cfg", dim=0)
        return both[0], both[1]


class Family:
    """Base class of a model family's part of the loop (see the module docstring)."""

    pipeline_classes: tuple[str, ...] = ()  # model_index.json `_class_name`s this family serves

    def __init__(self, components: dict[str, Any], index: dict[str, Any], branches: Branches,
                 device: Any, dtype: torch.dtype) -> None:
        self.components, self.index, self.branches = components, index, branches
        self.device, self.dtype = device, dtype

    def parallelize(self, ctx: Any) -> None:
        """Shard the transformer(s) for sequence / tensor parallel (`ctx.parallel`); default: nothing."""

    def shard_of(self, name: str, full: torch.Tensor, ctx: Any) -> torch.Tensor:
        """This rank's part of the FULL tensor `name` ("transformer.blocks.0.attn1.to_q.weight") of a
        weight update; default: all of it."""
        return full

    def start(self, request: Any) -> Job:
        raise NotImplementedError

    def join(self, jobs: list[Job]) -> None:
        """The jobs admitted since the last step, before their first: by default, nothing (a family
        that batches prompt encoding or shares schedulers overrides it)."""

    def step(self, jobs: list[Job]) -> None:
        raise NotImplementedError

    def decode(self, job: Job) -> torch.Tensor:
        raise NotImplementedError

    def denoise(self, transformer: Any, latents: torch.Tensor, timestep: torch.Tensor,
                embeds: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The ONE call of a transformer forward: a sharded transformer (sequence / tensor parallel)
        plugs in here with the same signature and result."""
        return transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds,
                           return_dict=False, **kwargs)[0]
