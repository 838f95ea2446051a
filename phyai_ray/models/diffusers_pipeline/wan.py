"""`WanFamily`: WanPipeline's math (Wan 2.1, Wan 2.2 with two experts, the TI2V layout), one step at a time.

What `WanPipeline.__call__` does for one prompt, split where the iteration protocol needs it:

    begin     latents ~ randn [1, C, (F-1)/4+1, H/8, W/8] from Generator("cpu").manual_seed(seed);
              its own scheduler copy, set_timesteps(n), set_begin_index(0) (stepwise's own_scheduler)
    encode    the jobs that arrived together: their prompts -> UMT5 embeddings in one call per
              branch, padded with zeros past each prompt's tokens to max_sequence_length (cond; and
              the negative prompts, uncond, when guidance_scale > 1); on a replica's encoding rank
              alone (every branch), the other ranks get them from it (encode_rank.py)
    join      jobs with one schedule and shape share one scheduler (a `Cohort`, family.py)
    step      per job: t = timesteps[i]; the expert is `transformer` while t >= boundary_ratio *
              num_train_timesteps (always, without boundary_ratio), else `transformer_2` with
              guidance_scale_2; per (expert, text length): ONE forward over the cond rows of every
              job, ONE over the uncond rows of those with guidance (as the pipeline's two calls, so
              one request alone equals it bit for bit), noise = u + g (c - u), then the scheduler step
              (one per cohort, else the job's own)
    decode    latents / latents_std + latents_mean -> VAE decode (tiled past the family's
              `tile_pixels`) -> (x / 2 + 0.5).clamp(0, 1)

TI2V (`expand_timesteps`): the timestep is given per latent token ([B, F * h/2 * w/2]), all equal
to t for text-to-video. With cfg_size 2, cfg rank 0 computes the cond rows and rank 1 the uncond
rows (zeros for jobs without guidance), gathered over group "cfg" (`Branches.gather`).
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray.models.diffusers_pipeline.family import Family, Job
from phyai_ray.stepwise.schedulers import advance, form_cohorts, own_scheduler


def _clean(text: str) -> str:
    """The prompt cleaning WanPipeline applies (ftfy when installed, html unescape, whitespace)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(text)


class WanFamily(Family):
    """Wan text-to-video (2.1, 2.2 two experts, 2.2 TI2V) as the per-family part of the step loop."""

    pipeline_classes = ("WanPipeline",)
    encoded = ("cond", "uncond")  # the prompt's and the negative prompt's embeddings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        c = self.components
        self.tokenizer, self.text_encoder, self.vae = c["tokenizer"], c["text_encoder"], c["vae"]
        self.scheduler = c["scheduler"]
        self.transformer, self.transformer_2 = c.get("transformer"), c.get("transformer_2")
        ratio = self.index.get("boundary_ratio")
        self.boundary = None if ratio is None else ratio * self.scheduler.config.num_train_timesteps
        self.expand = bool(self.index.get("expand_timesteps", False))
        self.temporal = self.vae.config.scale_factor_temporal
        self.spatial = self.vae.config.scale_factor_spatial
        first = self.transformer if self.transformer is not None else self.transformer_2
        self.channels, self.patch = first.config.in_channels, tuple(first.config.patch_size)
        self.model_dtype = first.dtype

    # -- parallel ---------------------------------------------------------------------------------
    def parallelize(self, ctx: Any) -> None:
        """Each expert becomes this rank's Ulysses / tensor-parallel shard (wan_parallel.py)."""
        from phyai_ray.models.diffusers_pipeline.wan_parallel import shard_wan

        for name in ("transformer", "transformer_2"):
            if self.components.get(name) is not None:
                setattr(self, name, shard_wan(self.components[name], ctx))

    def shard_of(self, name: str, full: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Tensor parallel: this rank's chunk of a split parameter, by diffusers' name."""
        from phyai_ray.models.diffusers_pipeline.wan_parallel import tp_shard_dim

        dim = tp_shard_dim(name.split(".", 1)[1])
        group = "dense_tp" if ".ffn." in name else "attention_tp"
        if dim is None or ctx.group_size(group) == 1:
            return full
        return full.chunk(ctx.group_size(group), dim)[ctx.group_rank(group)]

    # -- admission ----------------------------------------------------------------------------------
    def begin(self, request: Any) -> Job:
        r, guided = request, request["guidance_scale"] > 1.0
        cond: dict[str, Any] = {"guided": guided, "length": r["max_sequence_length"]}  # embeddings: `encode`
        from diffusers.utils.torch_utils import randn_tensor

        frames = (r["num_frames"] - 1) // self.temporal + 1
        shape = (1, self.channels, frames, r["height"] // self.spatial, r["width"] // self.spatial)
        latents = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(r["seed"]),
                               device=torch.device(self.device), dtype=torch.float32)
        schedule = own_scheduler(self.scheduler, r["num_inference_steps"], self.device, begin_index=0)
        return Job(request=r, value=latents, cond=cond, **schedule)

    def encode(self, jobs: list[Job]) -> None:
        """The prompts of the jobs that arrived together, encoded in one text-encoder call per branch and
        text length (as WanPipeline encodes an N-prompt call)."""
        lengths: dict[int, list[Job]] = {}
        for job in jobs:
            lengths.setdefault(job.cond["length"], []).append(job)
        for length, group in lengths.items():
            if self.encoding.cond:
                for job, row in zip(group, self._embed([job.request["prompt"] for job in group], length)):
                    job.cond["cond"] = row
            guided = [job for job in group if job.cond["guided"]]
            if guided and self.encoding.uncond:
                for job, row in zip(guided, self._embed([job.request["negative_prompt"] for job in guided], length)):
                    job.cond["uncond"] = row

    def join(self, jobs: list[Job]) -> None:
        """Jobs that enter the denoising set together with one schedule share a scheduler (`form_cohorts`)."""
        form_cohorts(jobs)

    @torch.no_grad()
    def _embed(self, texts: list[str], length: int) -> list[torch.Tensor]:
        """[1, length, d_model] per text, in the transformer's dtype, exactly as WanPipeline._get_t5_prompt_embeds."""
        tokens = self.tokenizer([_clean(text) for text in texts], padding="max_length", max_length=length,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, mask).last_hidden_state.to(self.text_encoder.dtype)
        used = mask.gt(0).sum(dim=1).tolist()
        return [torch.cat([hidden[k, :n], hidden.new_zeros(length - n, hidden.shape[-1])]).unsqueeze(0).to(self.model_dtype)
                for k, n in enumerate(used)]

    # -- one step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, jobs: list[Job]) -> None:
        """ONE denoising step of every job (they share a latent shape): one forward per (expert, text length)."""
        stacks: dict[tuple[int, int], list[Job]] = {}
        for job in jobs:
            stacks.setdefault((self._expert_index(job), job.cond["length"]), []).append(job)
        noise: dict[int, torch.Tensor] = {}
        for (expert, _), stack in stacks.items():
            self._guided_noise(self.transformer if expert == 0 else self.transformer_2, expert, stack, noise)
        advance(jobs, noise)  # every prediction first: a cohort's members may sit in different stacks

    def _expert_index(self, job: Job) -> int:
        t = job.timestep
        if self.transformer_2 is None or (self.boundary is not None and t >= self.boundary):
            return 0 if self.transformer is not None else 1
        return 1 if self.boundary is not None else 0

    def _guided_noise(self, transformer: Any, expert: int, jobs: list[Job], out: dict[int, torch.Tensor]) -> None:
        """Each job's guided noise prediction at its step, into `out[id(job)]`."""
        ts = torch.stack([job.timestep for job in jobs])
        latents = torch.cat([job.value for job in jobs])
        cond, uncond = self._predict(transformer, latents.to(self.model_dtype), ts, jobs)
        for k, job in enumerate(jobs):
            noise = cond[k:k + 1]
            if job.cond["guided"]:
                r = job.request
                g = r["guidance_scale"] if expert == 0 or self.boundary is None else (
                    r["guidance_scale_2"] if r["guidance_scale_2"] is not None else r["guidance_scale"])
                noise = uncond[k:k + 1] + g * (noise - uncond[k:k + 1])
            out[id(job)] = noise

    def _predict(self, transformer: Any, latents: torch.Tensor, ts: torch.Tensor,
                 jobs: list[Job]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(cond, uncond) noise predictions [B, ...]; uncond rows of unguided jobs are zeros (unused).

        One forward per branch, each over the rows of every job in the stack: the cond rows together,
        then the uncond rows together, as WanPipeline runs its two branches (so one request alone
        equals it bit for bit; cond and uncond rows in ONE forward differ from it by float rounding)."""
        b, guided = self.branches, [k for k, job in enumerate(jobs) if job.cond["guided"]]
        x, cond, uncond = self._inputs(latents, jobs), None, None
        if b.cond:
            cond = self._forward(transformer, x, ts, jobs, "cond")
        if b.uncond and guided:
            part = self._forward(transformer, x[guided], ts[guided], [jobs[k] for k in guided], "uncond")
            uncond = part if len(guided) == len(jobs) else torch.zeros_like(latents).index_copy_(
                0, torch.tensor(guided, device=part.device), part.to(latents.dtype))
        if b.cfg_size == 1:
            return cond, uncond
        local = cond if b.cond else (uncond if uncond is not None else torch.zeros_like(latents))
        return b.gather(local)

    def _inputs(self, latents: torch.Tensor, jobs: list[Job]) -> torch.Tensor:
        """The transformer's input rows for the stacked `latents` (a subclass may add conditioning channels)."""
        return latents

    def _forward(self, transformer: Any, x: torch.Tensor, ts: torch.Tensor, jobs: list[Job], branch: str) -> torch.Tensor:
        """One forward over `jobs`' rows with their `branch` ("cond" / "uncond") text embeddings."""
        return self.denoise(transformer, x, self._timestep(ts, x), torch.cat([job.cond[branch] for job in jobs]))

    def _timestep(self, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """[B] (or [B, tokens] for TI2V's expand_timesteps: t at every latent token)."""
        if not self.expand:
            return t
        _, _, f, h, w = latents.shape
        tokens = f * ((h + 1) // 2) * ((w + 1) // 2)  # WanPipeline: mask[0][0][:, ::2, ::2] * t, float32
        return (torch.ones(1, tokens, dtype=torch.float32, device=t.device) * t[:, None]).to(torch.float32)

    # -- decode ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, job: Job) -> torch.Tensor:
        """The job's video: float [frames, H, W, 3] in [0, 1], as WanPipeline's output_type="np"."""
        r = job.request
        vae, z = self.decoder(r["height"], r["width"]), self.vae.config.z_dim
        latents = job.value.to(dtype=vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        video = vae.decode(latents / std + mean, return_dict=False)[0]
        return (video[0] / 2 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).float()
