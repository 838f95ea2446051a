"""One Cosmos3 request: its fields, `Cosmos3OmniPipeline.__call__`'s defaults, and the rules it keeps.

    {"prompt": "a robot arm picks up the red cube",    str (or a list holding one str)
     "negative_prompt": None,                          str; None: "" as the pipeline
     "num_frames": 189, "height": 720, "width": 1280,  the pipeline's defaults (not for `action`)
     "fps": 24.0, "num_inference_steps": 35, "guidance_scale": 6.0, "seed": 0,
     "enable_sound": False,                            a waveform too: folders with a sound_tokenizer
     "output_type": "uint8",                           "uint8" / "float" video [frames, H, W, 3], "latent"
     "image": None, "video": None,                     uint8 [H, W, 3] (image-to-world) or [frames, H, W, 3]
                                                       (video-to-world: its first frames condition)
     "action": None}                                   robot work, diffusers' CosmosActionCondition fields:
        {"mode": "policy" | "forward_dynamics" | "inverse_dynamics", "chunk_size": 8,
         "domain_name": "droid_lerobot", "resolution_tier": 480, "view_point": "ego_view",
         "raw_actions": [[...], ...]}                  (forward_dynamics: [T, raw_action_dim])
        with `image` (policy, forward_dynamics) or `video` (inverse_dynamics) as the frames; the
        frame count is chunk_size + 1 and the size the tier's canvas (num_frames / height / width unset).

The result: {"video": ..., "steps": n} plus "action" [chunk_size x raw_action_dim] float32 for policy
and inverse_dynamics, and "sound" [channels, samples] float32 with enable_sound. A seed s gives what
`Cosmos3OmniPipeline(..., generator=torch.Generator("cpu").manual_seed(s))` gives.

openpi robot frames (`WS /v1/openpi`, an unmodified openpi-client `WebsocketClientPolicy`): with
plugin_args["policy"] set, a frame becomes a `policy` action request here, in the dispatcher (`Policy`):

    plugin_args["policy"] = {"chunk_size": 8, "domain_name": "droid_lerobot",   required
                             "resolution_tier": 480, "view_point": "ego_view",  as `action` (these defaults)
                             "num_inference_steps": 35, "guidance_scale": 6.0,  as a request (these defaults)
                             "seed": 0, "negative_prompt": None,
                             "mode": "policy", "image_key": "observation/image"}
    frame {"observation/image": uint8 [H, W, 3] or [3, H, W]     -> "image" (as [H, W, 3])
           "prompt": "pick up the cube",                        -> "prompt"
           "seed": 3}                                           -> "seed" (optional: else the policy's)
    -> {"prompt", "image", "seed", the policy's request fields, "output_type": "latent",
        "action": {"mode": "policy", "chunk_size", "domain_name", "resolution_tier", "view_point"}}
    reply {"actions": float32 [chunk_size, raw_action_dim], "steps": n}   (openpi clients read "actions")

A request is a frame when the policy is set and it names no Cosmos3 field but `prompt` and `seed`: every
request with `action`, `image`, `num_frames`, ... is a Cosmos3 request as above, and a bare {"prompt": ...}
is a frame without its camera (refused). Other "observation/..." keys (the state, more cameras) are
accepted and not read: Cosmos3's policy mode reads one camera and the prompt; `image_key` names which
camera (e.g. DROID's "observation/exterior_image_1_left"). Any other key is refused. The video is not
decoded (only the chunk goes back), so a frame costs its denoising steps and its image's VAE encode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from phyai_ray.models.diffusers_pipeline.folder import PipelineFolderError
from phyai_ray.models.diffusers_pipeline.request import VideoRequestError, check_steps

DEFAULT_FPS = 24.0  # Cosmos3's frame rate: a model input, and the rate of the clips it makes
FIELDS = ("prompt", "negative_prompt", "num_frames", "height", "width", "fps", "num_inference_steps",
          "guidance_scale", "seed", "enable_sound", "output_type", "image", "video", "action")
ACTION_FIELDS = ("mode", "chunk_size", "domain_name", "resolution_tier", "view_point", "raw_actions")
MODES = ("policy", "forward_dynamics", "inverse_dynamics")
DEFAULTS = {"num_frames": 189, "height": 720, "width": 1280}  # Cosmos3OmniPipeline.__call__, without `action`
POLICY_ACTION = ("chunk_size", "domain_name", "resolution_tier", "view_point")  # plugin_args["policy"] -> `action`
POLICY_REQUEST = ("num_inference_steps", "guidance_scale", "seed", "negative_prompt")  # -> the request's fields
POLICY_KEYS = ("mode", *POLICY_ACTION, *POLICY_REQUEST, "image_key")
FRAME_SIGNS = frozenset(FIELDS) - {"prompt", "seed"}  # a request naming one of these is not an openpi frame


@dataclass(frozen=True)
class FolderLimits:
    """What a Cosmos3 folder allows: its VAE factors, the transformer's patch, its heads."""

    temporal: int
    spatial: int
    patch: int
    sound: bool  # a sound_tokenizer and a transformer with sound_gen
    action: bool  # a transformer with action_gen
    action_dim: int

    @classmethod
    def of(cls, folder: Any) -> "FolderLimits":
        vae, tf = folder.configs["vae"], folder.transformer_config()
        return cls(temporal=int(vae.get("scale_factor_temporal") or 4),
                   spatial=int(vae.get("scale_factor_spatial") or 16),
                   patch=int(tf.get("latent_patch_size", 2)),
                   sound="sound_tokenizer" in folder.components() and bool(tf.get("sound_gen")),
                   action=bool(tf.get("action_gen")), action_dim=int(tf.get("action_dim") or 0))


@dataclass(frozen=True)
class Cosmos3Request:
    """A checked request with every default filled in; `to_payload()` is the dict the ranks get."""

    prompt: str
    negative_prompt: str | None = None
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    fps: float = DEFAULT_FPS
    num_inference_steps: int = 35
    guidance_scale: float = 6.0
    seed: int = 0
    enable_sound: bool = False
    output_type: str = "uint8"
    image: Any = None
    video: Any = None
    action: dict[str, Any] | None = None
    openpi: bool = False  # an openpi frame's request: its result is `openpi_reply`'s

    def to_payload(self) -> dict[str, Any]:
        return asdict(self)

    def latent_shape(self, channels: int, limits: Any) -> tuple[int, int, int, int]:
        """[C, F, h, w] of its video latents (an action request: its tier's canvas, an upper bound)."""
        frames, h, w = self.num_frames, self.height, self.width
        if self.action is not None:
            tier = int(self.action["resolution_tier"])
            frames, h, w = self.action["chunk_size"] + 1, tier, tier
        return (channels, (frames - 1) // limits.temporal + 1, h // limits.spatial, w // limits.spatial)


def parse(request: Any, folder: Any, caps: Any = None, policy: "Policy | None" = None) -> Cosmos3Request:
    """Check `request` against the rules and the folder (a checked `Folder`, or its `FolderLimits`) and
    the serving limits `caps` (request.py's `Limits`: max_frames, max_pixels from plugin_args); a
    VideoRequestError names the rule, or the limit and the plugin_args key that changes it. With a
    `policy` (plugin_args["policy"]), an openpi frame is first mapped onto its action request (see the
    module docstring). A request parsed before is returned as it is."""
    if isinstance(request, Cosmos3Request):
        return request
    if policy is not None and isinstance(request, dict) and not set(request) & FRAME_SIGNS:
        return replace(parse(policy.request(request), folder, caps), openpi=True)
    limits = folder if isinstance(folder, FolderLimits) else FolderLimits.of(folder)
    if not isinstance(request, dict):
        raise VideoRequestError(f"a Cosmos3 request is a dict such as {{'prompt': 'a red cube', 'num_frames': 9}}, "
                                f"got {type(request).__name__}")
    unknown = sorted(map(str, set(request) - set(FIELDS)))
    if unknown:
        frame = any(key.startswith("observation/") for key in unknown)
        raise VideoRequestError(f"unknown Cosmos3 request fields {unknown}; known: {list(FIELDS)}" + (
            " (an openpi frame: serve the folder with plugin_args['policy'], see cosmos3_request.py)" if frame else ""))
    values = {k: v for k, v in request.items() if v is not None}
    values["prompt"] = _text(request.get("prompt"))
    for name in ("image", "video"):
        if name in values:
            values[name] = frames_array(values[name], name, 3 if name == "image" else 4)
    if values.get("image") is not None and values.get("video") is not None:
        raise VideoRequestError("give `image` or `video` as the conditioning frames, not both")
    if values.get("action") is not None:
        values["action"] = _action(values, limits)
    else:
        for name, default in DEFAULTS.items():
            values[name] = _integer(values.get(name, default), name)
        _check_size(values, limits)
    values["num_inference_steps"] = _integer(values.get("num_inference_steps", 35), "num_inference_steps")
    values["seed"] = _integer(values.get("seed", 0), "seed")
    values["guidance_scale"] = float(values.get("guidance_scale", 6.0))
    values["fps"] = float(values.get("fps", DEFAULT_FPS))
    if values["num_inference_steps"] < 1 or not 0 <= values["seed"] < 2 ** 63 or values["fps"] <= 0:
        raise VideoRequestError(f"num_inference_steps={values['num_inference_steps']} must be >= 1, seed="
                                f"{values['seed']} in [0, 2**63) and fps={values['fps']} > 0")
    check_steps(values["num_inference_steps"], caps)
    if values.get("output_type", "uint8") not in ("uint8", "float", "latent"):
        raise VideoRequestError(f"output_type={values['output_type']!r} is not one of ['uint8', 'float', 'latent']")
    if caps is not None:
        _check_caps(values, caps)
    if values.get("enable_sound") and not limits.sound:
        raise VideoRequestError("enable_sound=True needs a folder with a sound_tokenizer and a transformer trained "
                                "with sound_gen=True; this folder has none: leave enable_sound unset")
    return Cosmos3Request(**values)


def _check_size(values: dict[str, Any], limits: FolderLimits) -> None:
    frames, h, w, s = values["num_frames"], values["height"], values["width"], limits.spatial
    if frames < 1 or (frames - 1) % limits.temporal:
        raise VideoRequestError(f"num_frames={frames} breaks the rule num_frames = {limits.temporal}k+1 (the VAE's "
                                f"temporal factor is {limits.temporal}), e.g. {limits.temporal * 2 + 1}")
    if h <= 0 or w <= 0 or h % s or w % s:
        raise VideoRequestError(f"height x width = {h} x {w} breaks the rule: multiples of {s} (the VAE's spatial "
                                f"factor), e.g. {max(s, h // s * s)} x {max(s, w // s * s)}")
    if values.get("video") is not None and frames == 1:
        raise VideoRequestError("video conditioning needs num_frames > 1")


def guardrail_wanted(folder: Any, plugin_args: dict[str, Any]) -> bool:
    """Whether a folder runs behind a safety checker: a Cosmos3 folder whose model_index.json keeps
    `enable_safety_checker` (the default; then one is required, as for every Cosmos checkpoint), or one
    whose plugin_args name one. Other pipeline classes: False (their own rule applies)."""
    if folder.class_name != "Cosmos3OmniPipeline":
        return False
    return bool(folder.index.get("enable_safety_checker", True)) or plugin_args.get("safety_checker") is not None


def _check_caps(values: dict[str, Any], caps: Any) -> None:
    """Frames and pixels per frame within plugin_args' max_frames / max_pixels (an action request: its
    chunk_size + 1 frames and its tier's largest canvas)."""
    frames, pixels = values.get("num_frames"), None
    if values.get("action") is not None:
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _ACTION_RESOLUTION_BINS

        frames = values["action"]["chunk_size"] + 1
        pixels = max(h * w for h, w in _ACTION_RESOLUTION_BINS[str(values["action"]["resolution_tier"])].values())
    else:
        pixels = values["height"] * values["width"]
    max_frames, max_pixels = getattr(caps, "max_frames", None), getattr(caps, "max_pixels", None)
    if max_frames is not None and frames > max_frames:
        raise VideoRequestError(f"{frames} frames are over the limit max_frames={max_frames} "
                                "(plugin_args['max_frames'] changes it)")
    if max_pixels is not None and pixels > max_pixels:
        raise VideoRequestError(f"{pixels} pixels per frame are over the limit max_pixels={max_pixels} "
                                "(plugin_args['max_pixels'] changes it)")


def _action(values: dict[str, Any], limits: FolderLimits) -> dict[str, Any]:
    """The `action` dict checked as CosmosActionCondition checks it, before any rank."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (_ACTION_RESOLUTION_BINS, _EMBODIMENT_TO_DOMAIN_ID,
                                                                  _EMBODIMENT_TO_RAW_ACTION_DIM)

    action = values["action"]
    if not isinstance(action, dict) or set(action) - set(ACTION_FIELDS):
        raise VideoRequestError(f"action must be a dict of {list(ACTION_FIELDS)}, got {action!r:.200}")
    if not limits.action:
        raise VideoRequestError("this folder's transformer has no action head (action_gen=False): leave action unset")
    clash = [name for name in ("num_frames", "height", "width") if name in values]
    if clash:
        raise VideoRequestError(f"an action request takes its frames from chunk_size + 1 and its size from "
                                f"resolution_tier: leave {clash} unset")
    out = {"mode": action.get("mode"), "chunk_size": _integer(action.get("chunk_size", 0), "action.chunk_size"),
           "domain_name": action.get("domain_name"), "resolution_tier": int(action.get("resolution_tier", 480)),
           "view_point": action.get("view_point", "ego_view"), "raw_actions": None}
    if out["mode"] not in MODES or out["chunk_size"] < 1:
        raise VideoRequestError(f"action.mode={out['mode']!r} must be one of {list(MODES)} and action.chunk_size="
                                f"{out['chunk_size']} at least 1")
    width = _EMBODIMENT_TO_RAW_ACTION_DIM.get(out["domain_name"])
    if out["domain_name"] not in _EMBODIMENT_TO_DOMAIN_ID or width is None:
        raise VideoRequestError(f"action.domain_name={out['domain_name']!r} is not one with a fixed action width; "
                                f"known: {sorted(_EMBODIMENT_TO_RAW_ACTION_DIM)}")
    if width > limits.action_dim:
        raise VideoRequestError(f"action.domain_name={out['domain_name']!r} has {width} action channels, more than "
                                f"this transformer's action_dim={limits.action_dim}")
    if str(out["resolution_tier"]) not in _ACTION_RESOLUTION_BINS:
        raise VideoRequestError(f"action.resolution_tier={out['resolution_tier']} is not one of "
                                f"{sorted(int(k) for k in _ACTION_RESOLUTION_BINS)}")
    frames = values.get("image") if values.get("image") is not None else values.get("video")
    if frames is None or (out["mode"] == "inverse_dynamics" and values.get("video") is None):
        raise VideoRequestError(f"action mode {out['mode']!r} needs its frames: `image` or `video` (inverse_dynamics: "
                                "`video`), uint8")
    if out["mode"] == "forward_dynamics":
        raw = np.asarray(action.get("raw_actions"), dtype=np.float32)
        if raw.ndim != 2 or raw.shape[0] < 1 or raw.shape[1] != width:
            raise VideoRequestError(f"action.raw_actions must be [T >= 1, {width}] for {out['domain_name']!r} "
                                    f"(forward_dynamics), got shape {list(raw.shape)}")
        out["raw_actions"] = raw
    return out


@dataclass(frozen=True)
class Policy:
    """plugin_args["policy"]: the `policy` action request an openpi frame becomes (module docstring).

        policy = Policy.of({"chunk_size": 8, "domain_name": "droid_lerobot"}, folder)
        policy.request({"observation/image": frame, "prompt": "pick up the cube"})  # -> a Cosmos3 request dict
    """

    action: dict[str, Any]  # mode "policy", chunk_size, domain_name, resolution_tier, view_point
    fields: dict[str, Any]  # num_inference_steps, guidance_scale, seed, negative_prompt (those given)
    image_key: str = "observation/image"
    metadata: dict[str, Any] = field(default_factory=dict)  # the openpi metadata frame (`Entry.policy_metadata`)

    @classmethod
    def of(cls, given: Any, folder: Any, caps: Any = None) -> "Policy | None":
        """The checked policy (None when `given` is None), or a PipelineFolderError before any rank starts:
        every rule of an action request is checked now, on a blank frame, against the folder and `caps`."""
        if given is None:
            return None
        example = {"chunk_size": 8, "domain_name": "droid_lerobot", "resolution_tier": 480, "num_inference_steps": 35}
        if not isinstance(given, dict) or set(given) - set(POLICY_KEYS) or given.get("mode", "policy") != "policy" \
                or not {"chunk_size", "domain_name"} <= set(given):
            raise PipelineFolderError(f"diffusers_pipeline: plugin_args['policy'] must be a dict of {list(POLICY_KEYS)}"
                                      f" with chunk_size and domain_name (mode: 'policy', the only one a frame asks "
                                      f"for), e.g. {example}; got {given!r:.200}")
        key = given.get("image_key", "observation/image")
        if not isinstance(key, str) or key in FIELDS:
            raise PipelineFolderError(f"diffusers_pipeline: plugin_args['policy']['image_key']={key!r} must be the "
                                      f"frame's camera key, a str that is not a Cosmos3 field {list(FIELDS)}")
        if getattr(folder, "class_name", None) != "Cosmos3OmniPipeline" or not FolderLimits.of(folder).action:
            raise PipelineFolderError("diffusers_pipeline: plugin_args['policy'] needs a Cosmos3OmniPipeline folder "
                                      "whose transformer has an action head (action_gen=True); "
                                      f"{getattr(folder, 'path', folder)} has none: leave 'policy' unset")
        policy = cls({"mode": "policy", **{k: given[k] for k in POLICY_ACTION if k in given}},
                     {k: given[k] for k in POLICY_REQUEST if k in given}, key)
        try:
            probe = parse(policy.request({key: np.zeros((16, 16, 3), np.uint8), "prompt": "-"}), folder, caps)
        except VideoRequestError as exc:
            raise PipelineFolderError(f"diffusers_pipeline: plugin_args['policy'] cannot serve frames: {exc}") from None
        return replace(policy, metadata=policy.describe(probe))

    def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        """The Cosmos3 request `frame` means, or a VideoRequestError naming the key."""
        known = [self.image_key, "prompt", "seed"]
        unknown = sorted(str(k) for k in frame if k not in known and not str(k).startswith("observation/"))
        if unknown:
            raise VideoRequestError(f"unknown openpi frame keys {unknown}; this Cosmos3 policy takes {known} (other "
                                    "'observation/...' keys are not read), or a Cosmos3 request's fields "
                                    f"{list(FIELDS)}")
        missing = [k for k in (self.image_key, "prompt") if frame.get(k) is None]
        if missing:
            raise VideoRequestError(f"the openpi frame lacks {missing}: the policy acts on {self.image_key!r} (uint8 "
                                    "[H, W, 3] or [3, H, W]) and the task in 'prompt'; got keys "
                                    f"{sorted(map(str, frame))}")
        seed = frame.get("seed", self.fields.get("seed", 0))
        return {**self.fields, "prompt": frame["prompt"], "image": _hwc(frame[self.image_key], self.image_key),
                "seed": seed, "output_type": "latent", "action": dict(self.action)}

    def describe(self, probe: Cosmos3Request) -> dict[str, Any]:
        """The metadata frame: the chunk's shape, the request every frame runs and the keys it reads."""
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _EMBODIMENT_TO_RAW_ACTION_DIM

        a = probe.action
        return {"policy": "diffusers_pipeline", "pipeline": "Cosmos3OmniPipeline", "mode": "policy",
                "action_horizon": a["chunk_size"], "chunk_size": a["chunk_size"],
                "action_dim": _EMBODIMENT_TO_RAW_ACTION_DIM[a["domain_name"]], "domain_name": a["domain_name"],
                "resolution_tier": a["resolution_tier"], "view_point": a["view_point"],
                "num_steps": probe.num_inference_steps, "guidance_scale": probe.guidance_scale,
                "openpi_keys": {self.image_key: "image: uint8 [H, W, 3] or [3, H, W]", "prompt": "prompt: str",
                                "seed": f"seed: int, optional (default {probe.seed})"}}


def openpi_reply(out: dict[str, Any]) -> dict[str, Any]:
    """An openpi frame's result: its chunk under openpi's "actions" (what the clients read), its steps
    and weight version; not its latents."""
    return {"actions": out["action"], **{k: out[k] for k in ("steps", "weight_version") if k in out}}


def _hwc(value: Any, key: str) -> np.ndarray:
    """A camera frame as uint8 [H, W, 3]: [3, H, W] (CHW) is transposed; a 3 on the last axis reads as HWC."""
    array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    if array.ndim == 3 and array.shape[0] == 3 and array.shape[-1] != 3:
        array = np.ascontiguousarray(array.transpose(1, 2, 0))
    return frames_array(array, key, 3)


def frames_array(value: Any, name: str, ndim: int) -> np.ndarray:
    """`image` [H, W, 3] or `video` [frames, H, W, 3] as uint8 numpy; else a VideoRequestError."""
    array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    if array.dtype != np.uint8 or array.ndim != ndim or array.shape[-1] != 3:
        want = "[H, W, 3]" if ndim == 3 else "[frames, H, W, 3]"
        raise VideoRequestError(f"{name} must be uint8 {want} (RGB), got {array.dtype} {list(array.shape)}")
    return array


def _text(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value.strip():
        raise VideoRequestError(f"prompt must be one non-empty str per request, got {type(value).__name__}; send "
                                "one request per prompt (they are batched per denoising step)")
    return value


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not float(value).is_integer():
        raise VideoRequestError(f"{name}={value!r} must be an integer")
    return int(value)
