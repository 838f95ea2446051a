"""One video request of `diffusers_pipeline`: its fields, diffusers' defaults, and the rules it must keep.

    {"prompt": "a robot arm picks up the red cube",     str (or a list holding one str)
     "negative_prompt": "",                             str; the unconditional branch's prompt
     "height": 480, "width": 832, "num_frames": 81,     WanPipeline's defaults
     "num_inference_steps": 50, "guidance_scale": 5.0,
     "guidance_scale_2": None,                          Wan 2.2 with two experts: the low-noise expert's
                                                        guidance (None: guidance_scale, as diffusers)
     "seed": 0,                                         the latents are drawn as diffusers draws them with
                                                        generator=torch.Generator("cpu").manual_seed(seed)
     "max_sequence_length": 512,                        text tokens (padded / truncated), as diffusers
     "output_type": "uint8",                            "uint8" video [frames, H, W, 3] (default),
                                                        "float" the same in [0, 1], "latent" the final
                                                        latents [C, F, h, w]
     "image": None, "video": None,                      Cosmos: uint8 [H, W, 3] (image-to-world) or
                                                        [frames, H, W, 3] (video-to-world); the Cosmos
                                                        defaults and rules are cosmos.py's (`cosmos_request`);
                                                        WanImageToVideoPipeline: `image` required (wan_i2v.py)
     "last_image": None}                                WanImageToVideoPipeline first-last-frame folders:
                                                        the last frame, uint8 [H, W, 3] (required there)

Where diffusers rounds a bad size down with a warning, a request here is refused with the rule
named: num_frames must be 4k+1 (the VAE's temporal factor), height and width multiples of the VAE's
spatial factor times the transformer's patch (and of 16, diffusers' own check). Sizes the folder
cannot serve are refused too, before any rank sees them (`Limits`, set by the entry from the
folder's configs): height or width beyond the transformer's positional range, more frames or
pixels per frame than the plugin_args `max_frames` / `max_pixels` allow (default: the folder's
recommended shape with a margin), a text longer than `max_sequence_length` tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from phyai_ray.errors import PhyAIError

OUTPUT_TYPES = ("uint8", "float", "latent")
FIELDS = ("prompt", "negative_prompt", "height", "width", "num_frames", "num_inference_steps", "guidance_scale",
          "guidance_scale_2", "seed", "max_sequence_length", "output_type", "image", "video", "last_image")


class VideoRequestError(PhyAIError, ValueError):
    """A request the folder's pipeline cannot run: the message names the rule and the values."""


@dataclass(frozen=True)
class Limits:
    """What a folder allows (folder.py reads it from the configs): sizes and the second guidance."""

    temporal: int  # VAE temporal factor: frames = temporal * k + 1
    spatial: int  # VAE spatial factor
    patch: tuple[int, int, int]  # transformer patch (t, h, w)
    two_experts: bool  # boundary_ratio set: guidance_scale_2 allowed
    conditioning: bool = False  # image / video conditioning frames allowed (Cosmos)
    last_image: bool = False  # a last frame allowed (WanImageToVideoPipeline; wan_i2v.py checks the layout)
    max_frames: int | None = None  # frames per video (plugin_args max_frames)
    max_pixels: int | None = None  # height x width per frame (plugin_args max_pixels)
    max_side: tuple[int, int] | None = None  # (height, width) the transformer's positions reach
    max_sequence_length: int | None = None  # text tokens (plugin_args max_sequence_length)
    max_steps: int | None = None  # denoising steps (plugin_args max_inference_steps; the scheduler's timesteps)

    @property
    def size_multiple(self) -> tuple[int, int]:
        h, w = self.spatial * self.patch[1], self.spatial * self.patch[2]
        return (h * 16 // _gcd(h, 16), w * 16 // _gcd(w, 16))


def check_steps(steps: int, limits: Any) -> None:
    """A VideoRequestError when `steps` is over the serving limit (`Limits.max_steps`), before any rank."""
    cap = getattr(limits, "max_steps", None)
    if cap is not None and steps > cap:
        raise VideoRequestError(f"num_inference_steps={steps} is over the limit max_inference_steps={cap} (the "
                                "scheduler's num_train_timesteps unless plugin_args['max_inference_steps'] sets "
                                "fewer); ask for fewer steps")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@dataclass(frozen=True)
class VideoRequest:
    """A checked request with every default filled in (a plain dict travels to the ranks)."""

    prompt: str
    negative_prompt: str = ""
    height: int = 480
    width: int = 832
    num_frames: int = 81
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    guidance_scale_2: float | None = None
    seed: int = 0
    max_sequence_length: int = 512
    output_type: str = "uint8"
    image: Any = None  # uint8 [H, W, 3] (Cosmos image-to-world)
    video: Any = None  # uint8 [frames, H, W, 3] (Cosmos video-to-world)
    last_image: Any = None  # uint8 [H, W, 3] (Wan first-last-frame-to-video)

    @classmethod
    def parse(cls, request: Any, limits: Limits) -> "VideoRequest":
        """Check `request` (a dict) against the rules and `limits`; raise VideoRequestError naming the rule."""
        if not isinstance(request, dict):
            raise VideoRequestError(f"a request is a dict such as {{'prompt': 'a red cube', 'num_frames': 9}}, "
                                    f"got {type(request).__name__}")
        unknown = sorted(set(request) - set(FIELDS))
        if unknown:
            raise VideoRequestError(f"unknown request fields {unknown}; known: {list(FIELDS)}")
        values = {k: v for k, v in request.items() if v is not None or k == "guidance_scale_2"}
        values["prompt"] = _one_text(request.get("prompt"), "prompt")
        values["negative_prompt"] = _one_text(request.get("negative_prompt") or "", "negative_prompt")
        for name in ("height", "width", "num_frames", "num_inference_steps", "seed", "max_sequence_length"):
            if name in values:
                values[name] = _integer(values[name], name)
        for name in ("guidance_scale", "guidance_scale_2"):
            if values.get(name) is not None:
                values[name] = float(values[name])
        parsed = cls(**values)
        parsed._check(limits)
        return parsed

    def _check(self, limits: Limits) -> None:
        if (self.num_frames - 1) % limits.temporal or self.num_frames < 1:
            k = max(0, (self.num_frames - 1) // limits.temporal)
            raise VideoRequestError(
                f"num_frames={self.num_frames} breaks the rule num_frames = {limits.temporal}k+1 (the VAE's "
                f"temporal factor is {limits.temporal}); use e.g. {limits.temporal * k + 1} or "
                f"{limits.temporal * (k + 1) + 1}")
        mh, mw = limits.size_multiple
        if self.height <= 0 or self.width <= 0 or self.height % mh or self.width % mw:
            raise VideoRequestError(
                f"height x width = {self.height} x {self.width} breaks the rule: height a multiple of {mh} and "
                f"width a multiple of {mw} (VAE spatial factor {limits.spatial} x patch {limits.patch[1:]}, "
                f"and 16); use e.g. {max(mh, self.height // mh * mh)} x {max(mw, self.width // mw * mw)}")
        self._check_bounds(limits)
        if self.num_inference_steps < 1:
            raise VideoRequestError(f"num_inference_steps={self.num_inference_steps} must be at least 1")
        check_steps(self.num_inference_steps, limits)
        if self.max_sequence_length < 1:
            raise VideoRequestError(f"max_sequence_length={self.max_sequence_length} must be at least 1")
        if self.guidance_scale_2 is not None and not limits.two_experts:
            raise VideoRequestError("guidance_scale_2 is for pipelines with two experts (boundary_ratio set); "
                                    "this folder has one transformer: leave guidance_scale_2 unset")
        if (self.image is not None or self.video is not None) and not limits.conditioning:
            raise VideoRequestError("image / video conditioning frames are for Cosmos2_5_PredictBasePipeline "
                                    "folders (`image` also for WanImageToVideoPipeline folders); this pipeline "
                                    "generates from text only: leave them unset")
        if self.last_image is not None and not limits.last_image:
            raise VideoRequestError("last_image is for WanImageToVideoPipeline first-last-frame folders; leave it unset")
        if self.output_type not in OUTPUT_TYPES:
            raise VideoRequestError(f"output_type={self.output_type!r} is not one of {list(OUTPUT_TYPES)}")
        if not 0 <= self.seed < 2 ** 63:
            raise VideoRequestError(f"seed={self.seed} must be in [0, 2**63)")

    def _check_bounds(self, limits: Limits) -> None:
        """What the folder cannot serve, refused before any rank: each message names the limit and its key."""
        if limits.max_side is not None and (self.height > limits.max_side[0] or self.width > limits.max_side[1]):
            raise VideoRequestError(
                f"height x width = {self.height} x {self.width} is beyond the transformer's positional range "
                f"(at most {limits.max_side[0]} x {limits.max_side[1]}, from its config.json); send a smaller video")
        if limits.max_pixels is not None and self.height * self.width > limits.max_pixels:
            raise VideoRequestError(
                f"height x width = {self.height} x {self.width} = {self.height * self.width} pixels per frame is "
                f"over the limit max_pixels={limits.max_pixels} (plugin_args['max_pixels'] changes it)")
        if limits.max_frames is not None and self.num_frames > limits.max_frames:
            raise VideoRequestError(f"num_frames={self.num_frames} is over the limit max_frames={limits.max_frames} "
                                    "(plugin_args['max_frames'] changes it)")
        if limits.max_sequence_length is not None and self.max_sequence_length > limits.max_sequence_length:
            raise VideoRequestError(
                f"max_sequence_length={self.max_sequence_length} text tokens is over the limit "
                f"max_sequence_length={limits.max_sequence_length} (plugin_args['max_sequence_length'] changes it)")

    def latent_shape(self, channels: int, limits: Limits) -> tuple[int, int, int, int]:
        """[C, F, h, w] of this request's latents."""
        return (channels, (self.num_frames - 1) // limits.temporal + 1, self.height // limits.spatial,
                self.width // limits.spatial)

    def to_payload(self) -> dict[str, Any]:
        return asdict(self)


def _one_text(value: Any, name: str) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, list):
        raise VideoRequestError(f"{name} is one text per request, got a list of {len(value)}; send one request "
                                "per prompt (they are batched per denoising step)")
    if not isinstance(value, str) or (name == "prompt" and not value.strip()):
        raise VideoRequestError(f"{name} must be a non-empty str" if name == "prompt" else f"{name} must be a str")
    return value


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not float(value).is_integer():
        raise VideoRequestError(f"{name}={value!r} must be an integer")
    return int(value)
