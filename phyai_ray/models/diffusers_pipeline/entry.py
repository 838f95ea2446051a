"""`DiffusersPipelineEntry`: serve a diffusers pipeline folder, `plugin="diffusers_pipeline"`.

    Engine(EngineConfig(plugin="diffusers_pipeline", plugin_args={"model": "/models/Wan2.1-T2V-1.3B-Diffusers"}))
    engine.submit({"prompt": "a robot arm picks up the red cube", "num_frames": 33, "height": 480,
                   "width": 832, "num_inference_steps": 30, "seed": 7}).result()["video"]  # uint8 [33, 480, 832, 3]

plugin_args: `model` (a local folder; never a hub name), `dtype` (default float32 on CPU, else the
folder's), `max_latent_tokens_per_step` (the per-iteration admission budget, see `cost`),
`safety_checker` (Cosmos: the guardrail's import path "package.module:Name", required, cosmos.py),
`vae_tile_pixels` (pixels per frame from which the VAE decodes in tiles, default 1280 x 720, 0 never). The
folder is checked here, in the dispatcher, before any rank starts (folder.py); each request is
checked against it (request.py) and refused alone, naming the rule. Each request is ONE sequence
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

DTYPES = ("float32", "bfloat16", "float16")
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

    def __init__(self, plugin_args: dict[str, Any] | None = None) -> None:
        self.folder: Folder | None = None
        self.limits: Limits | None = None
        self.args: dict[str, Any] = {}
        if plugin_args is not None:
            self.configure(plugin_args)

    def configure(self, plugin_args: dict[str, Any]) -> None:
        args = dict(plugin_args or {})
        unknown = sorted(set(args) - {"model", "dtype", "max_latent_tokens_per_step", "safety_checker",
                                      "vae_tile_pixels"})
        if unknown:
            raise PipelineFolderError(f"diffusers_pipeline: unknown plugin_args {unknown}; known: model, dtype, "
                                      "max_latent_tokens_per_step, safety_checker, vae_tile_pixels")
        if args.get("dtype") not in (None, *DTYPES):
            raise PipelineFolderError(f"diffusers_pipeline: dtype={args['dtype']!r} is not one of {list(DTYPES)}")
        tile_pixels(args)  # refused here, before any rank
        self.folder = _guarded(Folder.open(args.get("model")), args)
        self.args = args
        self.limits = self._limits(self.folder)
        self.inputs = (PROMPT, *CONDITIONING) if self.limits.conditioning else (PROMPT,)

    @staticmethod
    def _limits(folder: Folder) -> Limits:
        vae, tf = folder.configs["vae"], folder.transformer_config()
        return Limits(temporal=int(vae.get("scale_factor_temporal") or 4),
                      spatial=int(vae.get("scale_factor_spatial") or 8),
                      patch=tuple(int(p) for p in tf.get("patch_size", (1, 2, 2))),
                      two_experts=folder.index.get("boundary_ratio") is not None,
                      conditioning=folder.class_name in ("Cosmos2_5_PredictBasePipeline", "WanImageToVideoPipeline"),
                      last_image=folder.class_name == "WanImageToVideoPipeline")

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

            return parse(request, self._folder(), self.limits)
        if self._folder().class_name == "Cosmos2_5_PredictBasePipeline":
            from phyai_ray.models.diffusers_pipeline.cosmos import cosmos_request

            request = cosmos_request(request)
        elif self._folder().class_name == "WanImageToVideoPipeline":
            from phyai_ray.models.diffusers_pipeline.wan_i2v import i2v_request

            request = i2v_request(request, self._folder())
        return VideoRequest.parse(request, self._limits_checked())

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
        step each): `CostBudget` of plugin_args["max_latent_tokens_per_step"] (default: the batching
        config's max_num_batched_tokens). A request larger than the budget runs alone."""
        from phyai_ray.plugins.admission import per_step  # Turns: what the budget cannot hold takes turns

        return per_step(batching, batching.max_num_batched_tokens, given=self.args.get("max_latent_tokens_per_step"))

    def gather(self, request: Any, outputs: list[Any]) -> dict[str, Any]:
        [out] = outputs
        if not isinstance(out, dict):  # aborted between two denoising steps
            raise RequestAbortedError("the video request was aborted before its last denoising step; send it again")
        return out

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> Any:
        import torch

        from phyai_ray.models.diffusers_pipeline.model import PipelineModel

        folder = _guarded(Folder.open(plugin_args.get("model")), plugin_args)  # it may have changed since
        name = plugin_args.get("dtype")
        if name is None:
            on_cpu = torch.device(ctx.device).type == "cpu"
            dtype = torch.float32 if on_cpu else folder.weights_dtype()
        else:
            dtype = getattr(torch, name)
        model = PipelineModel(folder, dtype, ctx)
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


def _guarded(folder: Folder, plugin_args: dict[str, Any]) -> Folder:
    """A Cosmos folder gets its guardrail's import path, or is refused saying why and how (cosmos.py)."""
    if folder.class_name == "Cosmos2_5_PredictBasePipeline":
        from phyai_ray.models.diffusers_pipeline.cosmos import guardrail_path

        folder.guardrail = guardrail_path(plugin_args, folder.path)
    return folder

