"""`Family`: the model-family side of the denoising step loop (Wan, Cosmos, ...).

The per-rank model (`model.py`) owns the loop and knows nothing of any family:

    job = family.begin(request)         admission, on every rank (cheap): the latents drawn as the
                                        diffusers pipeline does for one prompt, its own scheduler copy
                                        with its timesteps set, the checks that refuse it alone
    family.encode(jobs)                 the ENCODE STAGE: the per-request work before the first step
                                        (prompt embeddings, image / video conditioning), for the jobs
                                        admitted together, in one call where the family can (Wan
                                        encodes their prompts in one text-encoder call); it runs on
                                        the encode stage's thread (stages.py), beside the loop's steps
    family.join(jobs)                   on the loop's thread, as they enter the denoising set: jobs
                                        with one schedule and latent shape may form a `Cohort`
    family.step(jobs)                   ONE denoising step of every job in `jobs` (they share a latent
                                        shape, `job.group`): the rows of every job stacked into one
                                        transformer forward per guidance branch (and expert), then
                                        each job's scheduler step; advances job.index
    family.decode(job)                  the DECODE STAGE: -> float video [frames, H, W, 3] in [0, 1]
                                        (the VAE, on `decoder(height, width)`: a view of it with
                                        caches of its own, tiled past `tile_pixels`), after the last
                                        step (`job.done`), on the decode stage's thread

`start(request)` is begin + encode for one request alone (a caller outside the loop, a test).

The step counting, each job's own scheduler copy (`own_scheduler`) and the cohorts that share one
scheduler over their stacked rows (`Cohort`, `form_cohorts`, `advance`) are the stepwise room's
(phyai_ray/stepwise/schedulers.py); a `Job` is a `ScheduledSequence` whose value is its latents.

A family module (`wan.py`, `cosmos.py`) subclasses `Family` and is named in `folder.PIPELINES` by
the pipeline class of the folder's model_index.json; `parallelize(ctx)` shards its transformers
and `shard_of` cuts a weight update's full tensor to this rank's part. Every rank of a replica runs the same
calls in the same order; collectives (the CFG gather) happen inside `step` only, never in a stage.
`Branches` says which guidance branches this rank computes: all of them on one rank, or cond on cfg
rank 0 and uncond on cfg rank 1 (`outer.cfg_size=2`), gathered with `Branches.gather`.

`encoded` names the keys of `job.cond` that `encode` writes (tensors or None). A family that names
them encodes on ONE rank of a replica (encode_rank.py): that rank's `encoding` is every branch, and
the model sends the tensors to the other ranks, which never run `encode` and hold no text or image
encoder. A family that names none (Cosmos3) encodes on every rank, its own branches (`encoding` is
`branches`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from phyai_ray.models.diffusers_pipeline.stages import TILE_PIXELS, decoder_views
from phyai_ray.stepwise.schedulers import ScheduledSequence


@dataclass(eq=False, kw_only=True)  # a job is itself: compared (and found in lists) by identity
class Job(ScheduledSequence):
    """One request on its way through the step loop (every rank holds the same jobs): its latents
    [1, C, F, h, w] float32 are its `value`, as the pipeline keeps them."""

    request: Any  # the parsed request (request.py)
    cond: dict[str, Any] = field(default_factory=dict)  # family-specific conditioning (embeddings, ...)

    @property
    def group(self) -> tuple[int, ...]:
        """Jobs whose latents share this shape are stacked into one forward."""
        return tuple(self.value.shape)


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
    encoded: tuple[str, ...] = ()  # the cond keys `encode` writes, sent from the encoding rank (see above)

    def __init__(self, components: dict[str, Any], index: dict[str, Any], branches: Branches,
                 device: Any, dtype: torch.dtype) -> None:
        self.components, self.index, self.branches = components, index, branches
        self.encoding = branches  # the branches `encode` fills: every one on a replica's encoding rank (model.py)
        self.device, self.dtype = device, dtype
        self.tile_pixels: int | None = TILE_PIXELS
        self._views: tuple[Any, Any] | None = None

    def parallelize(self, ctx: Any) -> None:
        """Shard the transformer(s) for sequence / tensor parallel (`ctx.parallel`); default: nothing."""

    def shard_of(self, name: str, full: torch.Tensor, ctx: Any) -> torch.Tensor:
        """This rank's part of the FULL tensor `name` ("transformer.blocks.0.attn1.to_q.weight") of a
        weight update; default: all of it."""
        return full

    def begin(self, request: Any) -> Job:
        raise NotImplementedError

    def encode(self, jobs: list[Job]) -> None:
        """The encode stage of the jobs admitted together (fills each job's `cond`); default: nothing."""

    def start(self, request: Any) -> Job:
        """One request's admission and encode stage, on the caller's thread."""
        job = self.begin(request)
        self.encode([job])
        return job

    def join(self, jobs: list[Job]) -> None:
        """The jobs whose encode finished, before their first step: by default, nothing (a family
        that shares schedulers across them overrides it)."""

    def step(self, jobs: list[Job]) -> None:
        raise NotImplementedError

    def decode(self, job: Job) -> torch.Tensor:
        raise NotImplementedError

    def outputs(self, job: Job) -> dict[str, Any]:
        """Results beside the video, after the last step (Cosmos3: the action chunk, the sound); default none."""
        return {}

    def decoder(self, height: int, width: int) -> Any:
        """The VAE view the decode stage uses for a video of height x width (stages.decoder_views): tiled
        when height * width >= `tile_pixels` (None or 0: never)."""
        if self._views is None:
            self._views = decoder_views(self.components["vae"], self.tile_pixels)
        plain, tiled = self._views
        return tiled if tiled is not None and height * width >= self.tile_pixels else plain

    def denoise(self, transformer: Any, latents: torch.Tensor, timestep: torch.Tensor,
                embeds: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The ONE call of a transformer forward: a sharded transformer (sequence / tensor parallel)
        plugs in here with the same signature and result."""
        return transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds,
                           return_dict=False, **kwargs)[0]
