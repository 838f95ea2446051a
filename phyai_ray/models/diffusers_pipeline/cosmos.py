"""`CosmosFamily`: Cosmos2_5_PredictBasePipeline's math (text-, image- and video-to-world), one step at a time.

What `Cosmos2_5_PredictBasePipeline.__call__` does for one prompt, split where the iteration protocol
needs it:

    begin     latents ~ randn [1, C, (F-1)/4+1, H/8, W/8] from Generator("cpu").manual_seed(seed);
              its own scheduler copy with its timesteps set (stepwise's own_scheduler)
    encode    (the encode stage) prompt -> Qwen2.5-VL chat template, padded to max_sequence_length
              -> every hidden state after the embeddings, each normalised over its channels, concatenated (cond; the negative prompt, uncond, when
              guidance_scale > 1, diffusers' long default negative prompt when none is given);
              conditioning frames: text-to-world none; image-to-world the image then black frames
              (1 frame conditions); video-to-world the last 5 frames of the clip, the last one repeated
              to num_frames (2 latent frames condition); the VAE encodes them (its mode, no noise
              drawn) -> cond_latent, normalised; cond_mask = 1 on the conditioning latent frames
    step      per job: sigma = its scheduler's sigmas[i]; the timestep per latent frame is 1e-4 on
              conditioning frames and sigma elsewhere; the input is cond_latent on conditioning
              frames, latents elsewhere; ONE forward over the cond rows of every job and the uncond
              rows of the guided ones; on conditioning frames the velocity is replaced by
              latents0 - cond_latent; noise = c + g (c - u) (Cosmos' form, not u + g (c - u));
              then the job's own scheduler step (stepwise's advance)
    decode    latents / latents_std + latents_mean -> VAE decode -> uint8 frames -> the guardrail's
              check_video (`guarded_video`) -> float [frames, H, W, 3] in [0, 1], as diffusers returns them

Cosmos checkpoints are licensed (NVIDIA Open Model License) with a guardrail: the entry refuses a
Cosmos folder without one (`guardrail.required_spec`) and checks each prompt once, in the
dispatcher; only the output rank holds the `Guardrail` (components["safety_checker"]) and checks
each video it decodes (guardrail.py).

diffusers calls two torchvision functions here (the transformer resizes its padding mask with
`transforms.functional.resize`, the pipeline reads an image with `to_tensor`); without torchvision
installed, `supply_torchvision` gives diffusers the same two operations.

Parallel layouts: CFG over 2 ranks (`outer.cfg_size=2`), and the transformer split by `parallelize`
(cosmos_parallel.py): Ulysses over attention.cp_size, heads and FFN over attention.tp_size ==
dense.tp_size; `shard_of` cuts a weight update's full tensor to this rank's part.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import torch

from phyai_ray.models.diffusers_pipeline.family import Family, Job
from phyai_ray.models.diffusers_pipeline.request import VideoRequestError
from phyai_ray.stepwise.schedulers import advance, own_scheduler

PIPELINE = "Cosmos2_5_PredictBasePipeline"
CONDITIONING_TIMESTEP = 0.0001  # the pipeline's conditional_frame_timestep
VIDEO_LATENT_FRAMES = 2  # the pipeline's num_latent_conditional_frames: 4 * (2 - 1) + 1 = 5 pixel frames
SYSTEM_PROMPT = "You are a helpful assistant who will provide prompts to an image generator."
DEFAULTS = {"height": 704, "width": 1280, "num_frames": 93, "num_inference_steps": 36, "guidance_scale": 7.0,
            "max_sequence_length": 512}  # Cosmos2_5_PredictBasePipeline.__call__'s defaults


# -- torchvision's two operations ---------------------------------------------------------------------------
def _resize(image: torch.Tensor, size: list[int], interpolation: Any = "nearest", **_: Any) -> torch.Tensor:
    """torchvision.transforms.functional.resize of a tensor with InterpolationMode.NEAREST (the only use)."""
    if str(getattr(interpolation, "value", interpolation)) != "nearest":
        raise NotImplementedError(f"resize with {interpolation!r}: only nearest is supplied without torchvision")
    return torch.nn.functional.interpolate(image, size=list(size), mode="nearest")


def to_tensor(picture: Any) -> torch.Tensor:
    """torchvision.transforms.functional.to_tensor of a uint8 [H, W, 3] array or PIL image: float [3, H, W] / 255."""
    array = np.array(picture, dtype=np.uint8, copy=True)
    return torch.from_numpy(array).permute(2, 0, 1).contiguous().to(torch.float32).div(255)


def supply_torchvision() -> None:
    """Give diffusers' Cosmos modules the two torchvision functions they call, when torchvision is absent."""
    from diffusers.models.transformers import transformer_cosmos
    from diffusers.pipelines.cosmos import pipeline_cosmos2_5_predict
    from diffusers.utils import is_torchvision_available

    if is_torchvision_available():
        return
    modes = types.SimpleNamespace(NEAREST="nearest")
    functional = types.SimpleNamespace(resize=_resize, to_tensor=to_tensor)
    transforms = types.SimpleNamespace(functional=functional, InterpolationMode=modes)
    transformer_cosmos.__dict__.setdefault("transforms", transforms)
    pipeline_cosmos2_5_predict.__dict__.setdefault("torchvision", types.SimpleNamespace(transforms=transforms))


# -- conditioning frames --------------------------------------------------------------------------------------
def cosmos_request(request: Any) -> Any:
    """A Cosmos request dict with the pipeline's defaults filled in where a field is absent or None (the
    negative prompt: diffusers' long default) and its conditioning frames checked, before request.py's rules."""
    if not isinstance(request, dict):
        return request  # VideoRequest.parse refuses it with an example
    filled = dict(request)
    for name, value in {**DEFAULTS, "negative_prompt": _default_negative()}.items():
        if filled.get(name) is None:
            filled[name] = value
    check_conditioning(filled)
    for name, ndim in (("image", 3), ("video", 4)):
        if filled.get(name) is not None:
            filled[name] = frames_array(filled[name], name, ndim)
    return filled


def frames_array(value: Any, name: str, ndim: int) -> np.ndarray:
    """A request's `image` ([H, W, 3]) or `video` ([frames, H, W, 3]) as uint8 numpy; else a VideoRequestError."""
    array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.dtype != np.uint8 or array.ndim != ndim or array.shape[-1] != 3:
        want = "[H, W, 3]" if ndim == 3 else "[frames, H, W, 3]"
        raise VideoRequestError(f"{name} must be uint8 {want} (RGB), got {array.dtype} {list(array.shape)}")
    return array


def check_conditioning(request: dict[str, Any]) -> None:
    """The rules for `image` / `video` in a Cosmos request (run before the request reaches a rank)."""
    image, video = request.get("image"), request.get("video")
    if image is not None and video is not None:
        raise VideoRequestError("give `image` (image-to-world) or `video` (video-to-world), not both")
    if image is not None:
        frames_array(image, "image", 3)
    if video is not None:
        need = 4 * (VIDEO_LATENT_FRAMES - 1) + 1
        got = frames_array(video, "video", 4).shape[0]
        frames = request.get("num_frames", DEFAULTS["num_frames"])
        if got < need or frames < need:
            raise VideoRequestError(f"video-to-world conditions on the last {need} frames of `video` and needs "
                             f"num_frames >= {need}; got a video of {got} frames and num_frames={frames}")


class CosmosFamily(Family):
    """Cosmos-Predict2.5 text-, image- and video-to-world as the per-family part of the step loop."""

    pipeline_classes = (PIPELINE,)
    encoded = ("cond", "uncond", "cond_latent", "indicator", "mask", "velocity")  # prompts' embeddings, frames' latents

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from diffusers.video_processor import VideoProcessor

        supply_torchvision()
        c = self.components
        self.guard = c.get("safety_checker")  # the output rank's Guardrail (loading.py); None elsewhere
        self.tokenizer, self.text_encoder, self.vae = c["tokenizer"], c["text_encoder"], c["vae"]
        self.transformer, self.scheduler = c["transformer"], c["scheduler"]
        self.temporal = 2 ** sum(self.vae.temperal_downsample)
        self.spatial = 2 ** len(self.vae.temperal_downsample)
        self.processor = VideoProcessor(vae_scale_factor=self.spatial, resample="bilinear")
        z = self.vae.config.z_dim
        self.latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1).float()
        self.latents_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1).float()  # inverse
        self.channels = self.transformer.config.in_channels - 1  # one channel carries the condition mask
        self.model_dtype = self.transformer.dtype

    # -- parallel ---------------------------------------------------------------------------------
    def parallelize(self, ctx: Any) -> None:
        """The transformer becomes this rank's Ulysses / tensor-parallel shard (cosmos_parallel.py)."""
        from phyai_ray.models.diffusers_pipeline.cosmos_parallel import shard_cosmos

        self.transformer = shard_cosmos(self.transformer, ctx)

    def shard_of(self, name: str, full: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Tensor parallel: this rank's chunk of a split parameter, by diffusers' name."""
        from phyai_ray.models.diffusers_pipeline.cosmos_parallel import cosmos_shard_of

        return cosmos_shard_of(name, full, ctx)

    # -- admission and the encode stage -------------------------------------------------------------
    def begin(self, request: Any) -> Job:
        """The latents and the scheduler copy (the prompt was checked in the dispatcher)."""
        r = request
        shape = (1, self.channels, (r["num_frames"] - 1) // self.temporal + 1, r["height"] // self.spatial,
                 r["width"] // self.spatial)
        from diffusers.utils.torch_utils import randn_tensor

        latents = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(r["seed"]),
                               device=torch.device(self.device), dtype=torch.float32)
        cond = {"guided": r["guidance_scale"] > 1.0, "length": r["max_sequence_length"]}
        return Job(request=r, value=latents, cond=cond,
                   **own_scheduler(self.scheduler, r["num_inference_steps"], self.device))

    @torch.no_grad()
    def encode(self, jobs: list[Job]) -> None:
        """Per job: its prompt embeddings (and the negative prompt's with guidance), its conditioning
        frames through the VAE, the masks."""
        for job in jobs:
            r, cond = job.request, job.cond
            if self.encoding.cond:
                cond["cond"] = self._embed(r["prompt"], cond["length"])
            if cond["guided"] and self.encoding.uncond:
                negative = r.get("negative_prompt")
                cond["uncond"] = self._embed(negative if negative is not None else _default_negative(), cond["length"])
            pixels, frames_in = self._conditioning_video(r)
            cond_latent = self._encode(pixels) if frames_in else None
            cond.update(self._masks(job.value, cond_latent, frames_in))

    def _embed(self, text: str, length: int) -> torch.Tensor:
        """[1, length, layers x hidden] exactly as Cosmos2_5_PredictBasePipeline._get_prompt_embeds."""
        chat = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
                {"role": "user", "content": [{"type": "text", "text": text}]}]
        ids = self.tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=False,
                                                 add_vision_id=False, max_length=length, truncation=True,
                                                 padding="max_length")
        ids = ids["input_ids"] if not isinstance(ids, list) and "input_ids" in ids else ids
        hidden = self.text_encoder(torch.LongTensor(ids)[None].to(self.device), output_hidden_states=True).hidden_states
        layers = [(h - h.mean(dim=-1, keepdim=True)) / (h.std(dim=-1, keepdim=True) + 1e-8) for h in hidden[1:]]
        return torch.cat(layers, dim=-1).to(dtype=self.text_encoder.dtype, device=self.device)

    def _conditioning_video(self, r: dict[str, Any]) -> tuple[torch.Tensor | None, int]:
        """The pixel clip the VAE encodes ([1, 3, F, H, W] in [-1, 1]) and how many frames condition."""
        frames, h, w = r["num_frames"], r["height"], r["width"]
        if r.get("image") is not None:
            image = to_tensor(frames_array(r["image"], "image", 3)).unsqueeze(0)
            clip = torch.cat([image, torch.zeros_like(image).repeat(frames - 1, 1, 1, 1)], dim=0).unsqueeze(0)
            return self.processor.preprocess_video(clip, h, w), 1
        if r.get("video") is not None:
            from PIL import Image

            pictures = [Image.fromarray(frame) for frame in frames_array(r["video"], "video", 4)]
            clip = self.processor.preprocess_video(pictures, h, w)
            need = 4 * (VIDEO_LATENT_FRAMES - 1) + 1
            clip = clip[:, :, -need:]
            if clip.shape[2] < frames:
                clip = torch.cat([clip, clip[:, :, -1:].repeat(1, 1, frames - clip.shape[2], 1, 1)], dim=2)
            return clip, need
        return None, 0

    def _encode(self, clip: torch.Tensor) -> torch.Tensor:
        """The VAE's mode of the clip, normalised by the latents' mean and std (float32)."""
        clip = clip.to(device=self.device, dtype=self.vae.dtype)
        latent = self.vae.encode(clip).latent_dist.mode().to(torch.float32)
        mean, std = (x.to(device=self.device, dtype=torch.float32) for x in (self.latents_mean, self.latents_std))
        return (latent - mean) * std

    def _masks(self, latents: torch.Tensor, cond_latent: torch.Tensor | None, frames_in: int) -> dict[str, Any]:
        """cond_latent, indicator [1, 1, T, 1, 1], mask [1, 1, T, H, W] and the fixed velocity of the
        conditioning frames (zero for text-to-world), as the pipeline's prepare_latents."""
        _, _, t, h, w = latents.shape
        indicator = torch.zeros(1, 1, t, 1, 1, dtype=latents.dtype, device=latents.device)
        if frames_in:
            indicator[:, :, :(frames_in - 1) // self.temporal + 1] = 1.0
        else:
            cond_latent = torch.zeros_like(latents)
        mask = indicator.expand(-1, -1, -1, h, w).to(self.model_dtype)
        return {"cond_latent": cond_latent, "indicator": indicator, "mask": mask,
                "velocity": (latents - cond_latent) * mask}

    # -- one step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, jobs: list[Job]) -> None:
        """ONE denoising step of every job (they share a latent shape): one forward per text length."""
        stacks: dict[int, list[Job]] = {}
        for job in jobs:
            stacks.setdefault(job.cond["length"], []).append(job)
        for stack in stacks.values():
            self._step_stack(stack)

    def _step_stack(self, jobs: list[Job]) -> None:
        inputs, times = [], []
        for job in jobs:
            c = job.cond
            sigma = job.scheduler.sigmas[job.index].to(device=self.device, dtype=torch.float32)
            times.append(c["indicator"] * CONDITIONING_TIMESTEP + (1 - c["indicator"]) * sigma.view(1, 1, 1, 1, 1))
            inputs.append((c["mask"] * c["cond_latent"] + (1 - c["mask"]) * job.value).to(self.model_dtype))
        cond, uncond = self._predict(torch.cat(inputs), torch.cat(times), jobs)
        predictions: dict[int, torch.Tensor] = {}
        for k, job in enumerate(jobs):
            c = job.cond
            noise = c["velocity"] + cond[k:k + 1] * (1 - c["mask"])
            if c["guided"]:
                negative = c["velocity"] + uncond[k:k + 1] * (1 - c["mask"])
                noise = noise + job.request["guidance_scale"] * (noise - negative)
            predictions[id(job)] = noise
        advance(jobs, predictions)  # each job's own scheduler step

    def _predict(self, x: torch.Tensor, t: torch.Tensor, jobs: list[Job]) -> tuple[torch.Tensor, torch.Tensor]:
        """(cond, uncond) velocity predictions [B, ...] (uncond rows of unguided jobs: zeros, unused)."""
        b, n = self.branches, len(jobs)
        guided = [k for k, job in enumerate(jobs) if job.cond["guided"]]
        rows = list(range(n)) if b.cond else []
        rows += guided if b.uncond else []
        if not rows:  # cfg rank 1 and no job has guidance: nothing to compute, zeros to gather
            out = torch.zeros_like(x)
            return b.gather(out) if b.cfg_size > 1 else (out, out)
        embeds = ([jobs[k].cond["cond"] for k in range(n)] if b.cond else []) + \
                 ([jobs[k].cond["uncond"] for k in guided] if b.uncond else [])
        masks = torch.cat([jobs[k].cond["mask"] for k in rows])
        padding = x.new_zeros(1, 1, jobs[0].request["height"], jobs[0].request["width"])
        pred = self.denoise(self.transformer, x[rows], t[rows], torch.cat(embeds), condition_mask=masks,
                            padding_mask=padding)
        if b.cfg_size == 1:
            uncond = torch.zeros_like(pred[:n])
            uncond[guided] = pred[n:]
            return pred[:n], uncond
        local = pred if b.cond else torch.zeros((n, *pred.shape[1:]), dtype=pred.dtype, device=pred.device)
        if not b.cond:
            local[guided] = pred
        return b.gather(local)

    # -- decode ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, job: Job) -> torch.Tensor:
        """The job's video after the guardrail: float [frames, H, W, 3] in [0, 1], as the pipeline's "np"."""
        latents, vae = job.value, self.decoder(job.request["height"], job.request["width"])
        mean, std = (x.to(latents.device, latents.dtype) for x in (self.latents_mean, self.latents_std))
        video = vae.decode((latents / std + mean).to(vae.dtype), return_dict=False)[0]
        frames = self.processor.postprocess_video(video, output_type="np")
        checked = guarded_video(self.guard, (frames[0] * 255).astype(np.uint8))
        video = torch.from_numpy(np.asarray(checked).astype(np.float32)[None] / 255.0 * 2 - 1).permute(0, 4, 1, 2, 3)
        return torch.from_numpy(self.processor.postprocess_video(video, output_type="np")[0])


def guarded_video(guard: Any, frames: np.ndarray) -> np.ndarray:
    """uint8 [F, H, W, 3] after the guardrail's video check (GuardrailError when it refuses); a Cosmos
    video is never returned unchecked, so a rank without the guardrail refuses to decode one."""
    if guard is None:
        raise RuntimeError(f"{PIPELINE}: this rank holds no guardrail, and only the output rank decodes "
                           "Cosmos videos (it holds the guardrail: loading.py)")
    return guard.check_video(frames)


def _default_negative() -> str:
    from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import DEFAULT_NEGATIVE_PROMPT

    return DEFAULT_NEGATIVE_PROMPT
