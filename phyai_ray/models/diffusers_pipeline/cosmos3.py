"""`Cosmos3Family`: Cosmos3OmniPipeline's math (text-, image-, video-to-world, robot actions, sound), step by step.

What `Cosmos3OmniPipeline.__call__` does for one prompt, split where the iteration protocol needs it:

    begin     its own scheduler copy with its timesteps set (stepwise's `own_scheduler`)
    encode    (the encode stage) an action request's canvas from its tier and frames; the prompt and
              the negative prompt with the pipeline's templates -> token ids (the transformer reads
              ids: no text encoder, so no text batch to form); the conditioning frames through the
              VAE and the noise of every stream (video, sound, action) from
              Generator("cpu").manual_seed(seed), by the pipeline's own `prepare_latents`; each
              conditioning clip cut to the frames its conditioning latent frames read
              (`_conditioning`), and the cut clips of the jobs admitted together that share a shape
              through the VAE in ONE call (`encode_clips`); the static layout of each branch (`static_row`,
              cosmos3_pack.py); one scheduler copy each for the sound and action streams, as the
              pipeline deep-copies its scheduler
    step      ONE packed forward over the cond rows of every job (any mode, prompt length, frame
              count, step), ONE over the uncond rows of the guided ones (the pipeline's two passes,
              so one request alone equals it bit for bit); velocities masked on the conditioning
              positions, v = u + g (c - u), then each stream's scheduler step
    decode    latents * std + mean -> the VAE -> float [frames, H, W, 3] in [0, 1] ("np"), through the
              guardrail's video check when the folder has one (the output rank's
              components["safety_checker"]; the prompt was checked once, in the dispatcher)
    outputs   {"action": [chunk, raw_action_dim]} (policy, inverse_dynamics), {"sound": [ch, samples]}

The transformer is diffusers' `Cosmos3OmniTransformer`, its attention processor replaced by
`PackedAttention` (cosmos3_attention.py): the same math, variable-length over the packed requests.
The small helpers of the pipeline (tokenize_prompt, prepare_latents, the segment builders, the
velocity mask, decode_sound) are called on a `Cosmos3OmniPipeline` built over the same components,
so the arithmetic is diffusers' own. With outer.cfg_size=2, cfg rank 0 runs the cond rows and rank 1
the uncond rows; the velocities are flattened per job and gathered over group "cfg".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from phyai_ray.models.diffusers_pipeline.cosmos3_attention import PackedAttention, TextCache, install
from phyai_ray.models.diffusers_pipeline.cosmos3_pack import Row, packed_forward, static_row
from phyai_ray.models.diffusers_pipeline.family import Family, Job
from phyai_ray.stepwise.schedulers import own_scheduler

PIPELINE = "Cosmos3OmniPipeline"
Streams = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # vision, sound, action velocities


@dataclass(eq=False, kw_only=True)
class Cosmos3Job(Job):
    """A Cosmos3 request: every job steps in the one packed forward, whatever its latent shape."""

    @property
    def group(self) -> tuple[Any, ...]:
        return (PIPELINE,)


class Cosmos3Family(Family):
    """Cosmos3 omni (world model, robot policy, sound) as the per-family part of the step loop."""

    pipeline_classes = (PIPELINE,)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from diffusers import Cosmos3OmniPipeline

        c = self.components
        self.transformer = c["transformer"]
        self.pipe = Cosmos3OmniPipeline(transformer=self.transformer, text_tokenizer=c["text_tokenizer"], vae=c["vae"],
                                        scheduler=c["scheduler"], sound_tokenizer=c.get("sound_tokenizer"),
                                        enable_safety_checker=False,
                                        default_use_system_prompt=self.index.get("default_use_system_prompt", True),
                                        use_native_flow_schedule=self.index.get("use_native_flow_schedule", False))
        self.attention = PackedAttention()
        install(self.transformer, self.attention)
        self.model_dtype = self.transformer.dtype

    # -- tensor parallel (cosmos3_parallel.py) -------------------------------------------------------------
    def parallelize(self, ctx: Any) -> None:
        from phyai_ray.models.diffusers_pipeline.cosmos3_parallel import shard_cosmos3

        shard_cosmos3(self.transformer, ctx)

    def shard_of(self, name: str, full: torch.Tensor, ctx: Any) -> torch.Tensor:
        from phyai_ray.models.diffusers_pipeline.cosmos3_parallel import tp_shard_dim

        dim, tp = tp_shard_dim(name.split(".", 1)[1]), ctx.group_size("attention_tp")
        return full if dim is None or tp == 1 else full.chunk(tp, dim)[ctx.group_rank("attention_tp")]

    # -- admission and the encode stage -----------------------------------------------------------------
    def begin(self, request: Any) -> Job:
        """Its scheduler copy; the rest is `encode` (the noise is drawn after the VAE reads the frames)."""
        schedule = self._schedule(request["num_inference_steps"], torch.device(self.device))
        return Cosmos3Job(request=request, value=None, cond={}, **schedule)

    @torch.no_grad()
    def encode(self, jobs: list[Job]) -> None:
        """Each job as the pipeline prepares it before its loop (see the module docstring), the VAE
        encode of their conditioning clips batched by shape: 8 policy frames on one tier canvas -> ONE
        VAE call of batch 8. A job whose clip cannot be built or encoded fails the call (the encode
        stage then encodes the jobs one by one to find whose, stages.py)."""
        plans = [self._plan(job.request) for job in jobs]
        for job, plan, latent in zip(jobs, plans, encode_clips(self.pipe, [plan["clip"] for plan in plans])):
            self._prepare(job, plan, latent)

    def _plan(self, r: dict[str, Any]) -> dict[str, Any]:
        """What the pipeline is called with for request `r` (its action condition, frames, height, width:
        an action request's canvas from its tier; its video as PIL frames), and what its VAE encode must
        give (`_conditioning`)."""
        action = _condition(r)
        frames, height, width = r["num_frames"], r["height"], r["width"]
        if action is not None:
            frames, (height, width) = action.chunk_size + 1, self._canvas(action)
        video = _pictures(r["video"]) if r["video"] is not None and action is None else None
        plan = {"action": action, "frames": frames, "height": height, "width": width, "video": video}
        return {**plan, **self._conditioning(r, plan)}

    def _latents(self, r: dict[str, Any], plan: dict[str, Any], vae_encode: Any) -> tuple[Any, ...]:
        """The pipeline's `prepare_latents` for `r`, its VAE encode (`_encode_video`) replaced by `vae_encode`."""
        action, pipe = plan["action"], self.pipe
        pipe._encode_video = vae_encode  # on this instance, for this call; the class's stays diffusers'
        try:
            return pipe.prepare_latents(image=r["image"] if action is None else None, video=plan["video"],
                                        num_frames=plan["frames"], height=plan["height"], width=plan["width"],
                                        fps=r["fps"], generator=torch.Generator("cpu").manual_seed(r["seed"]),
                                        device=torch.device(self.device), dtype=torch.float32,
                                        enable_sound=r["enable_sound"], action=action)
        finally:
            del pipe._encode_video

    def _conditioning(self, r: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
        """{"clip": the first frames of `r`'s conditioning clip, those its conditioning latents read, or None},
        from a dry run of `prepare_latents` over stand-in latents (zeros; its noise drawn and dropped).

        `prepare_latents` keeps the clip's latents only on the conditioning latent frames (vision mask 1;
        noise elsewhere), and the Wan VAE is causal in time (latent frame k reads pixel frames 0..4k), so
        the clip's first 4k+1 frames give those latents as the whole clip does: a policy frame (latent
        frame 0 of a 9-frame canvas) encodes 1 frame, text-to-world (no conditioning frame) none."""
        seen: list[torch.Tensor] = []

        def stand_in(clip: torch.Tensor) -> torch.Tensor:
            seen.append(clip)
            return _pad(None, clip, self.pipe)

        v_mask = self._latents(r, plan, stand_in)[5]
        if len(seen) != 1:
            raise RuntimeError(f"{PIPELINE}.prepare_latents encoded {len(seen)} clips for one request (seed "
                               f"{r['seed']}), cosmos3.py follows a version that encodes one: install the "
                               "diffusers version of the project's requirements")
        kept = torch.nonzero(v_mask[:, 0, 0] > 0).flatten()
        frames = 1 + self.pipe.vae.config.scale_factor_temporal * int(kept.max()) if len(kept) else 0
        return {"clip": seen[0][:, :, :frames] if frames else None}

    def _prepare(self, job: Job, plan: dict[str, Any], latent: torch.Tensor | None) -> None:
        """The job's prompt ids, latents, noise and static rows, given its encoded clip `latent` (None:
        it has no conditioning frame), zeros on the latent frames the pipeline draws as noise."""
        r, pipe, device, action = job.request, self.pipe, torch.device(self.device), plan["action"]
        cond_ids, uncond_ids = pipe.tokenize_prompt(
            r["prompt"], r["negative_prompt"], num_frames=plan["frames"], height=plan["height"],
            width=plan["width"], fps=r["fps"], action_mode=action.mode if action is not None else None,
            action_view_point=action.view_point if action is not None else None)
        (latents, sound, act, fps_v, fps_s, v_mask, s_mask, a_mask, domain, _, raw_dim,
         act_cond) = self._latents(r, plan, lambda clip: _pad(latent, clip, pipe))
        vision_cond = [int(i) for i in torch.nonzero(v_mask[:, 0, 0] > 0).flatten()]
        static = {branch: static_row(pipe, ids, latents, sound, act, (fps_v, fps_s), vision_cond, act_cond, device)
                  for branch, ids in (("cond", cond_ids), ("uncond", uncond_ids))}
        job.value = latents
        job.cond = {"guided": r["guidance_scale"] != 1.0, "static": static, "masks": (v_mask, s_mask, a_mask),
                    "domain": domain, "raw_dim": raw_dim, "sound": sound, "action": act,
                    "mode": action.mode if action is not None else None,
                    "text": {"cond": TextCache(), "uncond": TextCache()},  # its text keys / values, kept
                    "schedulers": (copy.deepcopy(job.scheduler) if sound is not None else None,
                                   copy.deepcopy(job.scheduler) if act is not None else None)}

    def _canvas(self, action: Any) -> tuple[int, int]:
        """An action request's (height, width): the tier's bin nearest its frames' aspect, as the pipeline."""
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _ACTION_RESOLUTION_BINS
        from diffusers.video_processor import VideoProcessor

        clip = [action.image] if action.image is not None else action.video
        probe = self.pipe.video_processor.preprocess_video(clip)
        return VideoProcessor.classify_height_width_bin(int(probe.shape[-2]), int(probe.shape[-1]),
                                                        ratios=_ACTION_RESOLUTION_BINS[str(action.resolution_tier)])

    def _schedule(self, steps: int, device: Any) -> dict[str, Any]:
        """own_scheduler, or the native flow schedule's sigmas when the folder asks for it (the pipeline's step 6)."""
        template = self.pipe.scheduler
        if not self.pipe.config.use_native_flow_schedule:
            return own_scheduler(template, steps, device)
        scheduler = copy.deepcopy(template)
        sigmas = np.linspace(1.0 - 1.0 / template.config.num_train_timesteps, 0.0, steps + 1)[:-1]
        scheduler.set_timesteps(steps, device=device, sigmas=sigmas)
        return {"scheduler": scheduler, "timesteps": scheduler.timesteps, "steps": len(scheduler.timesteps)}

    # -- one step -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, jobs: list[Job]) -> None:
        """ONE denoising step of every job: one packed forward per guidance branch, then each stream's step."""
        b = self.branches
        guided = [job for job in jobs if job.cond["guided"]]
        cond = self._velocities(jobs, "cond") if b.cond else None
        uncond = self._velocities(guided, "uncond") if b.uncond and guided else []
        if b.cfg_size > 1:
            cond, uncond = self._gather(jobs, guided, cond, uncond)
        at = {id(job): k for k, job in enumerate(guided)}
        for k, job in enumerate(jobs):
            self._advance(job, cond[k], uncond[at[id(job)]] if id(job) in at else None)

    def _velocities(self, jobs: list[Job], branch: str) -> list[Streams]:
        """Each job's masked velocities (float32) from ONE packed forward over its `branch` rows."""
        rows = [Row(static=job.cond["static"][branch], vision=job.value.to(self.model_dtype),
                    timestep=job.timestep.item(), sound=_cast(job.cond["sound"], self.model_dtype),
                    action=_cast(job.cond["action"], self.model_dtype), domain=job.cond["domain"],
                    text=job.cond["text"][branch]) for job in jobs]
        out = []
        for job, (v, s, a) in zip(jobs, packed_forward(self.transformer, self.attention, rows) if rows else []):
            v_mask, s_mask, a_mask = job.cond["masks"]
            streams = self.pipe._mask_velocity_predictions(
                [v], [s] if s is not None else None, vision_condition_mask=[v_mask],
                sound_condition_mask=[s_mask] if s_mask is not None else None,
                preds_action=[a] if a is not None else None,
                action_condition_mask=[a_mask] if a_mask is not None else None, raw_action_dim=job.cond["raw_dim"])
            out.append(tuple(x.float() if x is not None else None for x in streams))
        return out

    def _advance(self, job: Job, cond: Streams, uncond: Streams | None) -> None:
        """CFG per stream, then the scheduler step of each (vision on the job's own scheduler)."""
        t, g, c = job.timestep, job.request["guidance_scale"], job.cond

        def guide(i: int) -> torch.Tensor:
            return cond[i] if uncond is None else uncond[i] + g * (cond[i] - uncond[i])

        sound_scheduler, action_scheduler = c["schedulers"]
        if sound_scheduler is not None and cond[1] is not None:
            c["sound"] = sound_scheduler.step(guide(1).unsqueeze(0), t, c["sound"].unsqueeze(0),
                                              return_dict=False)[0].squeeze(0)
        a_mask = c["masks"][2]
        if action_scheduler is not None and cond[2] is not None and a_mask.sum() < a_mask.numel():
            c["action"] = action_scheduler.step(guide(2).unsqueeze(0), t, c["action"].unsqueeze(0),
                                                return_dict=False)[0].squeeze(0)
            if c["raw_dim"] is not None:
                c["action"][:, c["raw_dim"]:] = 0
        job.took(job.scheduler.step(guide(0).unsqueeze(0), t, job.value.unsqueeze(0), return_dict=False)[0].squeeze(0))

    def _gather(self, jobs: list[Job], guided: list[Job], cond: list[Streams] | None,
                uncond: list[Streams]) -> tuple[list[Streams], list[Streams]]:
        """CFG over 2 ranks: each rank's branch flattened per job (zeros for the other), gathered over "cfg"."""
        shapes = [_shapes(job) for job in jobs]
        at = {id(job): k for k, job in enumerate(guided)}
        if cond is not None:
            local = torch.cat([_flat(streams) for streams in cond])
        else:
            local = torch.cat([_flat(uncond[at[id(job)]]) if id(job) in at
                               else torch.zeros(_numel(s), device=self.device) for job, s in zip(jobs, shapes)])
        both_cond, both_uncond = self.branches.gather(local.to(self.device))
        cond_out, uncond_all = _split(both_cond, shapes), _split(both_uncond, shapes)
        return cond_out, [uncond_all[k] for k, job in enumerate(jobs) if id(job) in at]

    # -- decode -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, job: Job) -> torch.Tensor:
        """The job's video: float [frames, H, W, 3] in [0, 1], as the pipeline's output_type="np"."""
        pipe, latents = self.pipe, job.value
        scale = pipe.vae_scale_factor_spatial
        vae = self.decoder(latents.shape[-2] * scale, latents.shape[-1] * scale)  # the decode stage's VAE view
        mean = pipe._vae_latents_mean.to(device=latents.device, dtype=vae.dtype).view(1, -1, 1, 1, 1)
        inv_std = pipe._vae_latents_inv_std.to(device=latents.device, dtype=vae.dtype).view(1, -1, 1, 1, 1)
        decoded = vae.decode(latents.to(vae.dtype) / inv_std + mean).sample.to(latents.dtype)
        frames = pipe.video_processor.postprocess_video(decoded, output_type="np")[0]
        guard = self.components.get("safety_checker")  # the output rank's Guardrail, when the folder has one
        if guard is not None:  # as the pipeline's _apply_video_safety_check of "np" frames
            frames = guard.check_video((frames * 255).astype(np.uint8)).astype(np.float32) / 255.0
        return torch.from_numpy(frames)

    @torch.no_grad()
    def outputs(self, job: Job) -> dict[str, Any]:
        """The streams beside the video: the action chunk (policy, inverse_dynamics) and the sound waveform."""
        c, out = job.cond, {}
        if c["mode"] in ("policy", "inverse_dynamics") and c["action"] is not None:
            action = c["action"] if c["raw_dim"] is None else c["action"][:, :c["raw_dim"]]
            out["action"] = action.detach().float().cpu()
        if c["sound"] is not None:
            out["sound"] = self.pipe.decode_sound(c["sound"]).float().cpu()
        return out


def encode_clips(pipe: Any, clips: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """`pipe._encode_video` of each clip [1, 3, T, H, W] (None: none to encode), the clips of one shape in
    ONE call, split back per clip ([1, z, t, h, w] each, in order). diffusers' Wan VAE reads each sample
    of a batch on its own (its causal caches hold the batch), so a clip's latents do not depend on the
    others in its call: equal to the clip alone to float32 rounding (tests/test_diffusers_cosmos3_encode.py)."""
    out: list[torch.Tensor | None] = [None] * len(clips)
    shapes: dict[tuple[int, ...], list[int]] = {}
    for k, clip in enumerate(clips):
        if clip is not None:
            shapes.setdefault(tuple(clip.shape), []).append(k)
    for ks in shapes.values():
        latents = pipe._encode_video(torch.cat([clips[k] for k in ks]))
        for k, latent in zip(ks, latents.split(1)):
            out[k] = latent
    return out


def _pad(latent: torch.Tensor | None, clip: torch.Tensor, pipe: Any) -> torch.Tensor:
    """What `pipe._encode_video(clip)` gives in shape, dtype and device ([B, z, (T - 1) / 4 + 1, H / 16, W / 16]
    for the Wan 2.2 VAE): the encoded first latent frames `latent` (None: none), zeros after them."""
    b, _, t, h, w = clip.shape
    vae, scale = pipe.vae.config, pipe.vae_scale_factor_spatial
    full = clip.new_zeros(b, vae.z_dim, (t - 1) // vae.scale_factor_temporal + 1, h // scale, w // scale)
    if latent is not None:
        full[:, :, :latent.shape[2]] = latent
    return full


def _condition(r: dict[str, Any]) -> Any:
    """diffusers' CosmosActionCondition of a request's `action` (None without one)."""
    if r.get("action") is None:
        return None
    from diffusers import CosmosActionCondition

    a = r["action"]
    raw = torch.as_tensor(np.asarray(a["raw_actions"]), dtype=torch.float32) if a.get("raw_actions") is not None \
        else None
    video = _pictures(r["video"]) if r.get("video") is not None else None
    return CosmosActionCondition(mode=a["mode"], chunk_size=a["chunk_size"], domain_name=a["domain_name"],
                                 resolution_tier=a["resolution_tier"], raw_actions=raw, image=r.get("image"),
                                 video=video, view_point=a.get("view_point", "ego_view"))


def _pictures(video: Any) -> list[Any]:
    """uint8 [frames, H, W, 3] -> PIL frames, the form diffusers' video processor reads a clip in."""
    from PIL import Image

    return [Image.fromarray(frame) for frame in np.asarray(video)]


def _cast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(dtype)


def _shapes(job: Job) -> list[tuple[int, ...] | None]:
    c = job.cond
    return [tuple(job.value.shape), None if c["sound"] is None else tuple(c["sound"].shape),
            None if c["action"] is None else tuple(c["action"].shape)]


def _numel(shapes: list[tuple[int, ...] | None]) -> int:
    return sum(int(np.prod(s)) for s in shapes if s is not None)


def _flat(streams: Streams) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in streams if x is not None])


def _split(flat: torch.Tensor, shapes: list[list[tuple[int, ...] | None]]) -> list[Streams]:
    out, at = [], 0
    for job_shapes in shapes:
        parts = []
        for shape in job_shapes:
            if shape is None:
                parts.append(None)
                continue
            n = int(np.prod(shape))
            parts.append(flat[at:at + n].view(shape))
            at += n
        out.append(tuple(parts))
    return out
