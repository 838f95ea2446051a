"""`WanImageToVideoFamily`: WanImageToVideoPipeline's math (Wan 2.1 I2V, Wan 2.2 A14B), one step at a time.

What `WanImageToVideoPipeline.__call__` does for one prompt and one image, split where the iteration
protocol needs it (the rest is `WanFamily`'s: prompt encoding, cohorts in `join`, guidance, decode):

    encode    once per request (the encode stage, after WanFamily's prompt embeddings): the image
              (uint8 [H, W, 3] -> a PIL image, as the caller of diffusers gives it) -> the CLIP image
              processor -> the image encoder's second-to-last hidden states [1, tokens, image_dim]
              (`cond["image"]`, shared by both guidance branches);
              the image resized by the video processor to the request's height x width, in [-1, 1],
              followed by num_frames - 1 black frames -> the VAE's mode, normalised by the latents'
              mean and std -> latent_condition [1, 16, F, h, w]; the mask [1, 4, F, h, w]: 1 on the
              first pixel frame (repeated over the VAE's 4-frame temporal factor), 0 elsewhere;
              `cond["condition"]` = mask ++ latent_condition along channels (20 channels);
    begin     latents ~ randn [1, 16, F, h, w] and the scheduler copy as WanFamily.begin
    step      per (expert, text length) stack: the transformer input is latents ++ condition (16 + 20
              = 36 channels), `encoder_hidden_states_image` the stacked image embeddings; one forward
              for the cond rows, one for the uncond rows of the guided jobs, as WanFamily

First-last-frame folders (FLF2V: the transformer's `pos_embed_seq_len` = 2 x the CLIP tokens) take
`last_image` too, required there: both images go through CLIP in one call ([2, tokens, image_dim],
which the transformer folds into one row of 2 x tokens, so jobs stack row pairs in job order), the
last frame ends the VAE's clip instead of a black one and its mask is 1 as well.

Wan 2.2 I2V-A14B folders (`transformer_2`, `boundary_ratio`, transformers with `image_dim` null and no
CLIP tower) run WanFamily's two experts: `transformer` while t >= boundary_ratio x 1000 with
guidance_scale, then `transformer_2` with guidance_scale_2; no image embeddings (`uses_clip` False),
the image conditions through the VAE's latent_condition only, as in diffusers.

Parallel layouts are WanFamily's (`parallelize`: each expert sharded by wan_parallel.py): the image
rows are keys and values of the cross-attention (`add_k_proj` / `add_v_proj`, split by head under
tensor parallel, whole on every rank of a sequence split), the first-last-frame `pos_embed` is added to
the image rows before them, so neither needs more than Wan 2.1 text-to-video does.

Refused before any rank starts (`check_folder`): the TI2V layout (expand_timesteps), boundary_ratio
without transformer_2, a transformer without `image_dim` outside the A14B layout, experts that disagree
on `image_dim`, a CLIP path without its image_encoder / image_processor; per request (`i2v_request`): no
`image`, a `video`, an image not uint8 [H, W, 3], `last_image` missing on a first-last-frame folder
or given to another, and max_sequence_length other than 512 (diffusers' Wan attention splits its
context into image and text tokens at 512 text tokens, hard-coded).

The CLIP image processor is transformers' own class; without torchvision installed transformers
loads its PIL backend (`AutoImageProcessor`), as diffusers' pipeline then does too.
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
    """Refuse the WanImageToVideoPipeline layouts not served here (Folder.open calls it after its checks).

    Served: the Wan 2.1 I2V layout (one transformer with `image_dim`, the CLIP `image_encoder` and
    `image_processor`; first-last-frame with `pos_embed_seq_len`) and the Wan 2.2 A14B layout (two
    experts: `transformer`, `transformer_2` and `boundary_ratio`; no CLIP path, `image_dim` null)."""
    from phyai_ray.models.diffusers_pipeline.folder import PipelineFolderError

    index_file, tf = folder.path / "model_index.json", folder.transformer_config()
    where = folder.path / "transformer" / "config.json"
    ratio, second = folder.index.get("boundary_ratio"), folder.configs.get("transformer_2")
    refusals = [
        (ratio is not None and second is None, index_file,
         f"boundary_ratio={ratio} and no transformer_2 (the low-noise steps need the second expert)"),
        (bool(folder.index.get("expand_timesteps")), index_file, "expand_timesteps=true (the Wan 2.2 TI2V layout)"),
        (tf.get("image_dim") is None and ratio is None, where, "image_dim=null (a transformer without the CLIP "
                                                               "image path) and no boundary_ratio / transformer_2"),
        (second is not None and second.get("image_dim") != tf.get("image_dim"),
         folder.path / "transformer_2" / "config.json",
         f"image_dim={(second or {}).get('image_dim')} unlike the transformer's image_dim={tf.get('image_dim')}"),
    ]
    for refused, file, what in refusals:
        if refused:
            raise PipelineFolderError(f"{file}: {PIPELINE} with {what} is not supported; supported: the Wan 2.1 "
                                      "I2V layout (one transformer with image_dim, CLIP image_encoder) and the Wan "
                                      "2.2 A14B layout (transformer, transformer_2, boundary_ratio, image_dim null)")
    if tf.get("image_dim") is not None:
        _check_clip(folder, tf, where)


def _check_clip(folder: Any, tf: dict[str, Any], where: Any) -> None:
    """The CLIP path of a transformer with `image_dim`: the image encoder and processor present and agreeing."""
    from phyai_ray.models.diffusers_pipeline.folder import PipelineFolderError

    for name in ("image_encoder", "image_processor"):
        if name not in folder.configs:
            raise PipelineFolderError(f"{folder.path / 'model_index.json'}: {PIPELINE} needs component {name!r} "
                                      f"(the transformer's image_dim={tf['image_dim']} takes CLIP image embeddings), "
                                      "which the index does not name")
    clip, clip_file = folder.configs["image_encoder"], folder.path / "image_encoder" / "config.json"
    if clip.get("hidden_size") is not None and tf["image_dim"] != clip["hidden_size"]:
        raise PipelineFolderError(f"{where}: image_dim={tf['image_dim']} disagrees with the image encoder's "
                                  f"hidden_size={clip['hidden_size']} ({clip_file})")
    tokens = (clip.get("image_size", 224) // clip.get("patch_size", 32)) ** 2 + 1
    if tf.get("pos_embed_seq_len") not in (None, 2 * tokens):
        raise PipelineFolderError(f"{where}: pos_embed_seq_len={tf['pos_embed_seq_len']} is not 2 x the image "
                                  f"encoder's {tokens} tokens ({clip_file}): the first-last-frame layout embeds "
                                  "the two images side by side")


def first_last(folder: Any) -> bool:
    """A first-last-frame (FLF2V) folder: its transformer embeds two images (`pos_embed_seq_len` set), so
    every request gives `last_image`; any other I2V folder takes `image` only."""
    return folder.transformer_config().get("pos_embed_seq_len") is not None


def i2v_request(request: Any, folder: Any) -> Any:
    """An image-to-video request dict with its `image` (and `last_image` for a first-last-frame folder)
    checked (required, uint8 [H, W, 3]) and made numpy arrays, before request.py's rules; what this
    folder's layout does not take is refused naming the field."""
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
    last, flf = request.get("last_image"), first_last(folder)
    if flf and last is None:
        raise VideoRequestError(f"{folder.path} is a first-last-frame folder (its transformer's pos_embed_seq_len "
                                "is set): it needs `last_image`, the last frame, uint8 [H, W, 3] (RGB)")
    if not flf and last is not None:
        raise VideoRequestError(f"last_image needs a first-last-frame folder (pos_embed_seq_len set); {folder.path} "
                                "conditions on the first frame only: leave it unset")
    out = {**request, "image": image_array(request["image"])}
    return out if last is None else {**out, "last_image": image_array(last, "last_image")}


def image_array(value: Any, name: str = "image") -> np.ndarray:
    """`name` as uint8 numpy [H, W, 3]; else a VideoRequestError naming the field and what came."""
    array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3 or 0 in array.shape:
        raise VideoRequestError(f"{name} must be uint8 [H, W, 3] (RGB), got {array.dtype} {list(array.shape)}")
    return array


# -- the family -----------------------------------------------------------------------------------------------
class WanImageToVideoFamily(WanFamily):
    """Wan 2.1 image-to-video as the per-family part of the step loop (see the module docstring)."""

    pipeline_classes = (PIPELINE,)
    encoded = ("cond", "uncond", "image", "condition")  # the prompts', the image rows (CLIP), the VAE's condition

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from diffusers.video_processor import VideoProcessor

        self.image_encoder = self.components.get("image_encoder")  # none in the A14B layout
        self.image_processor = self.components.get("image_processor")
        first = self.transformer if self.transformer is not None else self.transformer_2
        self.uses_clip = first.config.image_dim is not None  # the Wan 2.2 A14B experts take no image embeddings
        self.video_processor = VideoProcessor(vae_scale_factor=self.spatial)
        self.channels = self.vae.config.z_dim  # the noisy latents; the transformer takes 20 channels more

    # -- the encode stage ---------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, jobs: list[Job]) -> None:
        """WanFamily's prompt embeddings, then per job its image rows (CLIP) and its condition (the VAE)."""
        super().encode(jobs)
        from PIL import Image

        for job in jobs:
            r = job.request
            first = Image.fromarray(image_array(r["image"]))
            last = None if r.get("last_image") is None else Image.fromarray(image_array(r["last_image"]))
            job.cond["image"] = self._embed_image(first if last is None else [first, last]) if self.uses_clip else None
            job.cond["condition"] = self._condition(first, last, r, job.value)

    def _embed_image(self, pictures: Any) -> torch.Tensor:
        """[1 or 2, tokens, image_dim] exactly as WanImageToVideoPipeline.encode_image, in the transformer's dtype
        (two rows for first and last frame: the transformer folds them into one row of 2 x tokens)."""
        pixels = self.image_processor(images=pictures, return_tensors="pt").to(self.image_encoder.device)
        hidden = self.image_encoder(**pixels, output_hidden_states=True).hidden_states[-2]
        return hidden.to(device=self.device, dtype=self.model_dtype)

    def _condition(self, first: Any, last: Any, r: dict[str, Any], latents: torch.Tensor) -> torch.Tensor:
        """mask ++ latent_condition [1, 4 + z, F, h, w] (float32) as the pipeline's prepare_latents: the
        first frame, black frames, and the last frame when given."""
        frames, height, width = r["num_frames"], r["height"], r["width"]
        given = [self.video_processor.preprocess(p, height=height, width=width).to(self.device, torch.float32)
                 .unsqueeze(2) for p in ([first] if last is None else [first, last])]
        black = given[0].new_zeros(1, given[0].shape[1], frames - len(given), height, width)
        clip = torch.cat([given[0], black, *given[1:]], dim=2)
        encoded = self.vae.encode(clip.to(device=self.vae.device, dtype=self.vae.dtype)).latent_dist.mode()
        z = self.vae.config.z_dim
        mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        latent_condition = (encoded.to(device=latents.device, dtype=latents.dtype) - mean) * std
        return torch.cat([self._mask(frames, last is not None, latents), latent_condition], dim=1)

    def _mask(self, frames: int, with_last: bool, latents: torch.Tensor) -> torch.Tensor:
        """[1, T, F, h, w] (T the temporal factor): the pixel frames of each latent frame that are given
        (the first, and the last with `last_image`), as the pipeline folds its per-pixel-frame mask."""
        _, _, _, h, w = latents.shape
        t = self.temporal
        mask = torch.ones(1, 1, frames, h, w)
        mask[:, :, 1:frames - 1 if with_last else frames] = 0
        mask = torch.cat([mask[:, :, :1].repeat_interleave(t, dim=2), mask[:, :, 1:]], dim=2)
        return mask.view(1, -1, t, h, w).transpose(1, 2).to(latents.device)

    # -- one step -----------------------------------------------------------------------------------------
    def _inputs(self, latents: torch.Tensor, jobs: list[Job]) -> torch.Tensor:
        """latents ++ each job's condition (36 channels), the Wan 2.1 I2V transformer's input."""
        return torch.cat([latents, torch.cat([job.cond["condition"] for job in jobs]).to(latents.dtype)], dim=1)

    def _forward(self, transformer: Any, x: torch.Tensor, ts: torch.Tensor, jobs: list[Job], branch: str) -> torch.Tensor:
        """WanFamily's forward with each job's image rows (1, or 2 for first and last frame) in job order; none
        for the Wan 2.2 A14B experts, which take no image embeddings."""
        images = torch.cat([job.cond["image"] for job in jobs]) if self.uses_clip else None
        return self.denoise(transformer, x, self._timestep(ts, x), torch.cat([job.cond[branch] for job in jobs]),
                            encoder_hidden_states_image=images)
