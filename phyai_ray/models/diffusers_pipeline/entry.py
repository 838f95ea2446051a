"""`DiffusersPipelineEntry`: serve a diffusers pipeline folder, `plugin="diffusers_pipeline"`.

    Engine(EngineConfig(plugin="diffusers_pipeline", plugin_args={"model": "/models/Wan2.1-T2V-1.3B-Diffusers"}))
    engine.submit({"prompt": "a robot arm picks up the red cube", "num_frames": 33, "height": 480,
                   "width": 832, "num_inference_steps": 30, "seed": 7}).result()["video"]  # uint8 [33, 480, 832, 3]

plugin_args: `model` (a local folder; never a hub name); `dtype`, `vae_dtype`, `text_encoder_dtype`
("auto" by default: float32 on CPU; on CUDA the transformers and text encoders in bfloat16, the VAE
and image encoder in float32; loading.py); `max_latent_tokens_per_step` (the per-iteration admission
budget, see `admission`); `max_frames`, `max_pixels`, `max_sequence_length` (request limits, see
`limits_of`); `safety_checker`, `safety_checker_args`, `safety_checker_download` (Cosmos: the
guardrail, required; guardrail.py); `vae_tile_pixels` (pixels per frame from which the VAE decodes in
tiles, default 1280 x 720, 0 never; stages.py); `policy` (Cosmos3: openpi frames as action requests,
cosmos3_request.py's `Policy`). The folder is checked here, in the dispatcher, before
any rank starts (folder.py); each request is checked against it (request.py) and refused alone, naming the
rule, and a Cosmos prompt is checked by the guardrail here, once. Each request is ONE sequence
of the iteration protocol, one denoising step per iteration, batched with every other running
request; its cost is its latent tokens (F * h/p * w/p) times its guidance branches (2 with CFG).

Parallel layouts: `outer.cfg_size=2` (cond on one rank group, uncond on the other, gathered each
step) and, for Wan (text- and image-to-video) and Cosmos-Predict2.5, attention.cp_size (Ulysses) and
attention.tp_size == dense.tp_size (wan_parallel.py, cosmos_parallel.py).
"""

from __future__ import annotations

from typing import Any

from phyai_ray.errors import ParallelConfigError, RequestAbortedError
from phyai_ray.models.diffusers_pipeline.folder import Folder, PipelineFolderError
from phyai_ray.models.diffusers_pipeline.stages import tile_pixels
from phyai_ray.models.diffusers_pipeline.request import Limits, VideoRequest, VideoRequestError
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.iteration import SequenceSpec
from phyai_ray.plugins.registry import register_plugin
from phyai_ray.plugins.signature import TensorSpec

DTYPES = ("auto", "float32", "bfloat16", "float16")
KNOWN = ("model", "dtype", "vae_dtype", "text_encoder_dtype", "max_latent_tokens_per_step", "max_frames",
         "max_pixels", "max_sequence_length", "safety_checker", "safety_checker_args", "safety_checker_download",
         "vae_tile_pixels", "policy", "max_inference_steps")
PIXEL_MARGIN, FRAME_MARGIN = 4, 2  # default limits: the recommended shape's pixels x 4 (2x a side), frames x 2
BUDGET_REQUESTS = 2  # the default per-step budget holds this many requests of the recommended shape
# The Open Inference Protocol's view: the prompt a BYTES tensor of shape [1], every other field a request
# parameter; conditioning frames UINT8 (Cosmos folders only); the video UINT8 [frames, H, W, 3] (FP32 for
# output_type "float", FP32 [C, F, h, w] for "latent") and the denoising steps it ran, INT64 [].
PROMPT = TensorSpec("prompt", "BYTES", (1,))
CONDITIONING = (TensorSpec("image", "UINT8", (-1, -1, 3), optional=True),
                TensorSpec("video", "UINT8", (-1, -1, -1, 3), optional=True))


@register_plugin
class DiffusersPipelineEntry(Entry):
    """A diffusers pipeline folder (WanPipeline) served one denoising step per iteration."""

    name = "diffusers_pipeline"
    parallel_domains = frozenset({"cfg", "dense", "attention"})
    inputs = (PROMPT, *CONDITIONING)  # a configured Wan folder lists the prompt only (configure)
    outputs = (TensorSpec("video", "UINT8", (-1, -1, -1, 3)), TensorSpec("steps", "INT64", ()))
    generates_video = True  # the HTTP app serves OpenAI's Videos API for it (serve/protocols/openai/videos.py)
    video_fps = 16.0  # the MP4's frame rate when a request names none (Wan's and Cosmos-Predict2.5's; Cosmos3's 24)
    video_fps_input = False  # whether the model takes the fps as an input (Cosmos3): the Videos API passes it on

    def __init__(self, plugin_args: dict[str, Any] | None = None) -> None:
        self.folder: Folder | None = None
        self.limits: Limits | None = None
        self.args: dict[str, Any] = {}
        self.guard: Any = None  # the dispatcher's Guardrail (Cosmos): never pickled to the ranks
        self.policy: Any = None  # Cosmos3's openpi frames (cosmos3_request.Policy), from plugin_args["policy"]
        if plugin_args is not None:
            self.configure(plugin_args)

    def configure(self, plugin_args: dict[str, Any]) -> None:
        args = dict(plugin_args or {})
        unknown = sorted(set(args) - set(KNOWN))
        if unknown:
            raise PipelineFolderError(f"diffusers_pipeline: unknown plugin_args {unknown}; known: {list(KNOWN)}")
        for key in ("dtype", "vae_dtype", "text_encoder_dtype"):
            if args.get(key) not in (None, *DTYPES):
                raise PipelineFolderError(f"diffusers_pipeline: {key}={args[key]!r} is not one of {list(DTYPES)}")
        tile_pixels(args)  # refused here, before any rank
        self.use(_guarded(Folder.open(args.get("model")), args), args)
        self.inputs = (PROMPT, *CONDITIONING) if self.limits.conditioning else (PROMPT,)
        self.guard = None
        if self.folder.guardrail is not None:  # the prompt check runs here, in the dispatcher, once per request
            from phyai_ray.models.diffusers_pipeline.guardrail import Guardrail

            self.guard = Guardrail.load(*self.folder.guardrail)

    def use(self, folder: Folder, args: dict[str, Any]) -> None:
        """Serve `folder` (already opened and checked) with plugin_args `args`: its limits and inputs."""
        from phyai_ray.models.diffusers_pipeline.cosmos3_request import DEFAULT_FPS, Policy

        self.folder, self.args = folder, args
        self.limits = limits_of(folder, args)
        self.policy = Policy.of(args.get("policy"), folder, self.limits)
        cosmos3 = folder.class_name == "Cosmos3OmniPipeline"  # conditioned on its frame rate (24 by default)
        self.video_fps, self.video_fps_input = (DEFAULT_FPS, True) if cosmos3 else (type(self).video_fps, False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "guard": None}  # the ranks never check prompts; the output rank loads its own

    def served_name(self) -> str:
        return self._folder().path.resolve().name

    # -- checks before any rank starts -------------------------------------------------------------
    def validate_parallel(self, parallel: Any) -> None:
        folder = self._folder()  # pipeline stages: refused by check_parallel (no "pipeline" domain)
        if folder.class_name in ("WanPipeline", "WanImageToVideoPipeline"):
            from phyai_ray.models.diffusers_pipeline.wan_parallel import validate_wan_parallel

            validate_wan_parallel(folder.transformer_config(), parallel)
        elif folder.class_name == "Cosmos2_5_PredictBasePipeline":
            from phyai_ray.models.diffusers_pipeline.cosmos_parallel import validate_cosmos_parallel

            validate_cosmos_parallel(folder.transformer_config(), parallel)
        elif folder.class_name == "Cosmos3OmniPipeline":
            from phyai_ray.models.diffusers_pipeline.cosmos3_parallel import validate_cosmos3_parallel

            validate_cosmos3_parallel(folder.transformer_config(), parallel)
        elif parallel.split_axes().keys() - {"cfg"}:
            raise ParallelConfigError(f"{folder.class_name} runs outer.cfg_size 1 or 2 only; got "
                                      f"{parallel.describe()} (sequence and tensor parallel are Wan's and "
                                      "Cosmos-Predict2.5's)")

    def validate_request(self, request: Any) -> VideoRequest:
        if isinstance(request, VideoRequest):
            return request
        if self._folder().class_name == "Cosmos3OmniPipeline":  # its own fields (action, sound): cosmos3_request.py
            from phyai_ray.models.diffusers_pipeline.cosmos3_request import parse

            parsed = parse(request, self._folder(), self.limits, self.policy)  # an openpi frame: its action request
            if self.guard is not None:  # the folder's guardrail (cosmos3_request.guardrail_wanted)
                self.guard.check_text(parsed.prompt)
            return parsed
        if self._folder().class_name == "Cosmos2_5_PredictBasePipeline":
            from phyai_ray.models.diffusers_pipeline.cosmos import cosmos_request

            request = cosmos_request(request)
        elif self._folder().class_name == "WanImageToVideoPipeline":
            from phyai_ray.models.diffusers_pipeline.wan_i2v import i2v_request

            request = i2v_request(request, self._folder())
        parsed = VideoRequest.parse(request, self._limits_checked())
        if self.guard is not None:
            self.guard.check_text(parsed.prompt)
        return parsed

    def sequences(self, request: Any) -> list[SequenceSpec]:
        """One sequence per request; cost = latent tokens x guidance branches; group = latent shape;
        steps = its num_inference_steps (one denoising step per iteration: with a deadline, finish-by
        admission runs it only if that many iterations of the replica's recent length end in time)."""
        parsed = self.validate_request(request)
        shape = parsed.latent_shape(int(self._folder().transformer_config().get("in_channels", 16)), self.limits)
        return [SequenceSpec(payload=parsed.to_payload(), cost=self.cost(parsed), group=shape,
                             steps=parsed.num_inference_steps)]

    def cost(self, request: VideoRequest) -> int:
        """Latent tokens (F * h/p_h * w/p_w) times guidance branches (2 when guidance_scale > 1)."""
        c, f, h, w = request.latent_shape(1, self._limits_checked())
        p = self.limits.patch
        return (f // p[0]) * (h // p[1]) * (w // p[2]) * (2 if request.guidance_scale > 1.0 else 1)

    def admission(self, batching: Any) -> Any:
        """Every running request re-costs its latent tokens x branches in every iteration (one denoising
        step each): `CostBudget` of plugin_args["max_latent_tokens_per_step"], by default `default_budget`
        (the model's: two requests of the folder's recommended shape), in `Turns` (`per_step`: what the
        budget cannot hold takes turns per step). A request larger than the budget runs alone."""
        from phyai_ray.plugins.admission import per_step

        return per_step(batching, self.default_budget(batching.max_num_batched_tokens),
                        given=self.args.get("max_latent_tokens_per_step"))

    def recommended_request(self) -> VideoRequest:
        """The folder's recommended shape (its pipeline's default request) with its default guidance."""
        height, width, frames = self._folder().recommended()
        guidance = 7.0 if self._folder().class_name == "Cosmos2_5_PredictBasePipeline" else 5.0
        return VideoRequest(prompt="-", height=height, width=width, num_frames=frames, guidance_scale=guidance)

    def default_budget(self, floor: int = 0) -> int:
        """Latent tokens x branches per step: BUDGET_REQUESTS requests of the recommended shape (at least `floor`)."""
        return max(int(floor), BUDGET_REQUESTS * self.cost(self.recommended_request()))

    def gather(self, request: Any, outputs: list[Any]) -> dict[str, Any]:
        [out] = outputs
        if not isinstance(out, dict):  # aborted between two denoising steps
            raise RequestAbortedError("the video request was aborted before its last denoising step; send it again")
        if getattr(request, "openpi", False):  # an openpi frame: the chunk as "actions" (cosmos3_request.py)
            from phyai_ray.models.diffusers_pipeline.cosmos3_request import openpi_reply

            return openpi_reply(out)
        return out

    def policy_metadata(self) -> dict[str, Any]:
        """openpi's metadata frame: plugin_args["policy"]'s chunk, action width and frame keys ({} without one)."""
        return dict(self.policy.metadata) if self.policy is not None else {}

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> Any:
        import torch

        from phyai_ray.models.diffusers_pipeline.model import PipelineModel

        from phyai_ray.models.diffusers_pipeline.loading import component_dtypes

        folder = _guarded(Folder.open(plugin_args.get("model")), plugin_args)  # it may have changed since
        model = PipelineModel(folder, component_dtypes(plugin_args, torch.device(ctx.device)), ctx)
        model.family.tile_pixels = tile_pixels(plugin_args)  # the decode stage's tiled VAE from this size up
        return model

    # -- helpers ------------------------------------------------------------------------------------
    def _folder(self) -> Folder:
        if self.folder is None:
            raise VideoRequestError("diffusers_pipeline needs plugin_args={'model': '/path/to/pipeline-folder'}")
        return self.folder

    def _limits_checked(self) -> Limits:
        self._folder()
        return self.limits


def limits_of(folder: Folder, args: dict[str, Any]) -> Limits:
    """The folder's request limits: the transformer's positional range always; `max_frames` and
    `max_pixels` from plugin_args, by default the recommended shape's frames x FRAME_MARGIN (4k+1) and
    pixels x PIXEL_MARGIN (480 x 832 x 81 -> 161 frames, 1,597,440 pixels); `max_sequence_length` from
    plugin_args, by default the text encoder's positional range (else 512)."""
    temporal, spatial, patch = folder.factors()
    frames_reach, height_reach, width_reach = folder.positional_range()
    height, width, frames = folder.recommended()
    max_frames = _limit(args, "max_frames", FRAME_MARGIN * (frames - 1) + 1, frames_reach, "frames")
    max_pixels = _limit(args, "max_pixels", PIXEL_MARGIN * height * width, height_reach * width_reach, "pixels")
    text_reach = folder.text_range()
    return Limits(temporal=temporal, spatial=spatial, patch=patch,
                  two_experts=folder.index.get("boundary_ratio") is not None,
                  conditioning=folder.class_name in ("Cosmos2_5_PredictBasePipeline", "WanImageToVideoPipeline"),
                  last_image=folder.class_name == "WanImageToVideoPipeline", max_frames=min(max_frames, frames_reach),
                  max_pixels=max_pixels, max_side=(height_reach, width_reach),
                  max_sequence_length=_limit(args, "max_sequence_length", text_reach, text_reach, "text tokens"),
                  max_steps=_limit(args, "max_inference_steps", folder.step_range(), folder.step_range(),
                                   "denoising steps (the scheduler's num_train_timesteps)"))


def _limit(args: dict[str, Any], key: str, default: int, reach: int, what: str) -> int:
    value = args.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= reach:
        raise PipelineFolderError(f"diffusers_pipeline: plugin_args['{key}']={value!r} must be an int in "
                                  f"[1, {reach}] (the {what} this folder's model reaches)")
    return value


def _guarded(folder: Folder, plugin_args: dict[str, Any]) -> Folder:
    """A Cosmos folder gets its guardrail (spec, args, download), or is refused saying why and how (guardrail.py)."""
    from phyai_ray.models.diffusers_pipeline.cosmos3_request import guardrail_wanted

    if folder.class_name == "Cosmos2_5_PredictBasePipeline" or guardrail_wanted(folder, plugin_args):
        from phyai_ray.models.diffusers_pipeline.guardrail import checker_spec, required_spec, resolve

        spec, args, download = checker_spec(plugin_args)
        spec = required_spec(plugin_args, folder.path, folder.class_name)
        resolve(spec)  # refuse a bad import path here, before any rank starts
        folder.guardrail = (spec, args, download)
    elif plugin_args.get("safety_checker") is not None:  # refused rather than ignored: no video check here
        raise PipelineFolderError(f"diffusers_pipeline: plugin_args['safety_checker'] is for folders whose decode "
                                  f"checks each video (Cosmos); this folder is a {folder.class_name}: leave it unset")
    return folder

