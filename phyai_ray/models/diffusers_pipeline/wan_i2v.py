"""`WanImageToVideoFamily`: WanImageToVideoPipeline's math (the Wan 2.1 I2V layout), one step at a time.

What `WanImageToVideoPipeline.__call__` does for one prompt and one image, split where the iteration
protocol needs it (the rest is `WanFamily`'s: prompt encoding in `join`, cohorts, guidance, decode):

    start     once per request: the image (uint8 [H, W, 3] -> a PIL image, as the caller of diffusers
              gives it) -> the CLIP image processor -> the image encoder's second-to-last hidden
              states [1, tokens, image_dim] (`cond["image"]`, shared by both guidance branches);
              the image resized by the video processor to the request's height x width, in [-1, 1],
              followed by num_frames - 1 black frames -> the VAE's mode, normalised by the latents'
              mean and std -> latent_condition [1, 16, F, h, w]; the mask [1, 4, F, h, w]: 1 on the
              first pixel frame (repeated over the VAE's 4-frame temporal factor), 0 elsewhere;
              `cond["condition"]` = mask ++ latent_condition along channels (20 channels);
              latents ~ randn [1, 16, F, h, w] and the scheduler copy as WanFamily.start
    step      per (expert, text length) stack: the transformer input is latents ++ condition (16 + 20
              = 36 channels), `encoder_hidden_states_image` the stacked image embeddings; one forward
              for the cond rows, one for the uncond rows of the guided jobs, as WanFamily

Refused before any rank starts (`check_folder`): the Wan 2.2 layouts (boundary_ratio / transformer_2,
expand_timesteps) and a transformer without `image_dim` (no CLIP path), the first-last-frame layout
(`pos_embed_seq_len`); per request (`i2v_request`): no `image`, a `video`, an image not uint8
[H, W, 3], and max_sequence_length other than 512 (diffusers' Wan attention splits its context into
image and text tokens at 512 text tokens, hard-coded).

The CLIP image processor is transformers' own class; without torchvision installed transformers
loads its PIL backend (`AutoImageProcessor`), which the tests give diffusers' pipeline as well.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from phyai_ray.models.diffusers_pipeline.family import Job
from phyai_ray.models.diffusers_pipeline.request import VideoRequestError
from phyai_ray.models.diffusers_pipeline.wan import WanFamily

PIPELINE = "WanImageToVideoPipeline"
TEXT_TOKENS = 512  # diffusers' WanAttnProcessor: image tokens = context length - 512


# -- checks before any rank starts --------------------------------------------------------------------------
def check_folder(folder: Any) -> None:
    """Refuse the WanImageToVideoPipeline layouts served here not (Folder.open calls it after its checks)."""
    from phyai_ray.models.diffusers_pipeline.folder import PipelineFolderError

    index_file, tf = folder.path / "model_index.json", folder.transformer_config()
    where = folder.path / "transformer" / "config.json"
    refusals = [
        (folder.index.get("boundary_ratio") is not None or "transformer_2" in folder.components(), index_file,
         f"boundary_ratio={folder.index.get('boundary_ratio')} / transformer_2 (the Wan 2.2 A14B two-expert layout)"),
        (bool(folder.index.get("expand_timesteps")), index_file, "expand_timesteps=true (the Wan 2.2 TI2V layout)"),
        (tf.get("image_dim") is None, where, "image_dim=null (a transformer without the CLIP image path)"),
        (tf.get("pos_embed_seq_len") is not None, where,
         f"pos_embed_seq_len={tf.get('pos_embed_seq_len')} (the first-last-frame layout, `last_image`)"),
    ]
    for refused, file, what in refusals:
        if refused:
            raise PipelineFolderError(f"{file}: {PIPELINE} with {what} is not supported; supported: the Wan 2.1 "
                                      "I2V layout (one transformer with image_dim, CLIP image_encoder)")
    hidden = folder.configs["image_encoder"].get("hidden_size")
    if hidden is not None and tf["image_dim"] != hidden:
        raise PipelineFolderError(f"{where}: image_dim={tf['image_dim']} disagrees with the image encoder's "
                                  f"hidden_size={hidden} ({folder.path / 'image_encoder' / 'config.json'})")


def i2v_request(request: Any) -> Any:
    """An image-to-video request dict with its `image` checked (required, uint8 [H, W, 3]) and made a numpy
    array, before request.py's rules; what this layout does not take is refused naming the field."""
    if not isinstance(request, dict):
        return request  # VideoRequest.parse refuses it with an example
    if request.get("image") is None:
        raise VideoRequestError(f"{PIPELINE} needs `image`: the first frame, uint8 [H, W, 3] (RGB); the request "
                                "has none")
    if request.get("video") is not None:
        raise VideoRequestError(f"{PIPELINE} conditions on one `image`; `video` is for Cosmos folders: leave it unset")
    length = request.get("max_sequence_length")
    if length is not None and length != TEXT_TOKENS:
        raise VideoRequestError(f"max_sequence_length={length}: {PIPELINE}'s transformer splits its context into "
                                f"image and text tokens at {TEXT_TOKENS} text tokens; leave it unset or {TEXT_TOKENS}")
    return {**request, "image": image_array(request["image"])}


def image_array(value: Any) -> np.ndarray:
    """`image` as uint8 numpy [H, W, 3]; else a VideoRequestError naming the field and what came."""
    array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3 or 0 in array.shape:
        raise VideoRequestError(f"image must be uint8 [H, W, 3] (RGB), got {array.dtype} {list(array.shape)}")
    return array


# -- the family -----------------------------------------------------------------------------------------------
class WanImageToVideoFamily(WanFamily):
    """Wan 2.1 image-to-video as the per-family part of the step loop (see the module docstring)."""

    pipeline_classes = (PIPELINE,)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from diffusers.video_processor import VideoProcessor

        self.image_encoder, self.image_processor = self.components["image_encoder"], self.components["image_processor"]
        self.video_processor = VideoProcessor(vae_scale_factor=self.spatial)
        self.channels = self.vae.config.z_dim  # the noisy latents; the transformer takes 20 channels more

    def parallelize(self, ctx: Any) -> None:
        """CFG over 2 ranks only (the entry refuses sequence / tensor parallel for this class)."""

    # -- admission ----------------------------------------------------------------------------------
    @torch.no_grad()
    def start(self, request: Any) -> Job:
        job = super().start(request)
        from PIL import Image

        picture = Image.fromarray(image_array(request["image"]))
        job.cond["image"] = self._embed_image(picture)
        job.cond["condition"] = self._condition(picture, request, job.latents)
        return job

    def _embed_image(self, picture: Any) -> torch.Tensor:
        """[1, tokens, image_dim] exactly as WanImageToVideoPipeline.encode_image, in the transformer's dtype."""
        pixels = self.image_processor(images=picture, return_tensors="pt").to(self.image_encoder.device)
        hidden = self.image_encoder(**pixels, output_hidden_states=True).hidden_states[-2]
        return hidden.to(device=self.device, dtype=self.model_dtype)

    def _condition(self, picture: Any, r: dict[str, Any], latents: torch.Tensor) -> torch.Tensor:
        """mask ++ latent_condition [1, 4 + z, F, h, w] (float32) as the pipeline's prepare_latents."""
        frames, height, width = r["num_frames"], r["height"], r["width"]
        image = self.video_processor.preprocess(picture, height=height, width=width).to(self.device, torch.float32)
        image = image.unsqueeze(2)
        clip = torch.cat([image, image.new_zeros(1, image.shape[1], frames - 1, height, width)], dim=2)
        encoded = self.vae.encode(clip.to(device=self.vae.device, dtype=self.vae.dtype)).latent_dist.mode()
        z = self.vae.config.z_dim
        mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        latent_condition = (encoded.to(device=latents.device, dtype=latents.dtype) - mean) * std
        return torch.cat([self._mask(frames, latents), latent_condition], dim=1)

    def _mask(self, frames: int, latents: torch.Tensor) -> torch.Tensor:
        """[1, T, F, h, w] (T the temporal factor): the pixel frames of each latent frame that are given
        (the first one only), as the pipeline folds its per-pixel-frame mask into latent frames."""
        _, _, _, h, w = latents.shape
        t = self.temporal
        mask = torch.ones(1, 1, frames, h, w)
        mask[:, :, 1:] = 0
        mask = torch.cat([mask[:, :, :1].repeat_interleave(t, dim=2), mask[:, :, 1:]], dim=2)
        return mask.view(1, -1, t, h, w).transpose(1, 2).to(latents.device)

    # -- one step -----------------------------------------------------------------------------------------
    def _predict(self, transformer: Any, latents: torch.Tensor, ts: torch.Tensor,
                 jobs: list[Job]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(cond, uncond) noise predictions [B, 16, ...] as WanFamily._predict, the transformer's input being
        latents ++ condition (36 channels) with each row's image embeddings beside its text."""
        b, guided = self.branches, [k for k, job in enumerate(jobs) if job.cond["guided"]]
        x = torch.cat([latents, torch.cat([job.cond["condition"] for job in jobs]).to(latents.dtype)], dim=1)
        images = torch.cat([job.cond["image"] for job in jobs])
        cond = uncond = None
        if b.cond:
            cond = self._forward_i2v(transformer, x, ts, [job.cond["cond"] for job in jobs], images)
        if b.uncond and guided:
            part = self._forward_i2v(transformer, x[guided], ts[guided], [jobs[k].cond["uncond"] for k in guided],
                                     images[guided])
            uncond = part if len(guided) == len(jobs) else torch.zeros_like(latents).index_copy_(
                0, torch.tensor(guided, device=part.device), part.to(latents.dtype))
        if b.cfg_size == 1:
            return cond, uncond
        local = cond if b.cond else (uncond if uncond is not None else torch.zeros_like(latents))
        return b.gather(local)

    def _forward_i2v(self, transformer: Any, x: torch.Tensor, ts: torch.Tensor, embeds: list[torch.Tensor],
                     images: torch.Tensor) -> torch.Tensor:
        return self.denoise(transformer, x, self._timestep(ts, x), torch.cat(embeds), encoder_hidden_states_image=images)
