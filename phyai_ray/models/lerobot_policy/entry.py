"""`LeRobotPolicyEntry`: LeRobot SmolVLA, pi0 and pi0.5 checkpoints, one action-expert step per iteration.

    phyai-ray serve lerobot_policy --plugin-args '{"model": "ckpt/pretrained_model", "vlm": "ckpt/smolvlm"}'
    Engine(EngineArgs(plugin="lerobot_policy", plugin_args={"model": ..., "vlm": ...}))

plugin_args:
    model      a LeRobot `pretrained_model` folder (config.json "type": smolvla, pi0 or pi05),
               model.safetensors, the pre/postprocessor JSONs and their normalizer .safetensors
    vlm        SmolVLA's backbone folder (config.json, tokenizer): its `vlm_model_name` as a local
               folder; a hub name with no folder given is refused, naming the folder to give
    tokenizer  pi0 / pi0.5: the local PaliGemma tokenizer folder (their processors name
               google/paligemma-3b-pt-224, which is never downloaded)
    sizes      pi0 / pi0.5 sizes other than their variant names' (see pi0.py), e.g. tiny test models
    max_prefix_cache  the admission seam: frames join an expert step while their prefix caches
               ((cameras x image tokens + tokenizer_max_length [+ 1 state]) x VLM layers each) fit it
    batch_prefixes  true (default): the frames admitted in one plan run their prefixes as ONE VLM pass
               (right-padded, masked); false: one pass per frame (the same numbers; for measuring)
    prefix_budget  joining frames' prefix work per iteration (tokens x layers, SigLIP's and the VLM's);
               a larger pass goes on in the next iterations, so running robots keep their step
               cadence while others join (joins.py); default: none (every prefix whole at once)
    dtype      "float32", "bfloat16" or "float16"; default: bfloat16 on CUDA (the checkpoint's own
               `dtype` field where it has one), float32 on CPU (memory.py)
    max_image_side  the largest height or width a camera frame may have (default 2048): a larger one
               is refused in the dispatcher, before any rank resizes it
    openpi_format  "droid", "aloha", "libero" or "lerobot": openpi's client formats (split states, nested
               CHW cameras; phyai_ray/stepwise/formats.py); default: detected from each frame's keys
    openpi_keys  {openpi-client key: checkpoint key}, default {"observation/image": first camera,
               "observation/wrist_image": second camera, "observation/state": the state, "prompt": "task"}

Everything is checked here, before any rank starts: the folder, the policy type, the statistics the
normalization modes need, and every tensor of model.safetensors against the shapes the model code
builds from the config (a network on the meta device: no memory). A frame (the robot frame format of
phyai_ray/stepwise/frames.py, laid out by request.py) is one sequence; each iteration advances every
running frame one Euler step (policy.py).
"""

from __future__ import annotations

from typing import Any

from phyai_ray.errors import RequestAbortedError
from phyai_ray.models.lerobot_policy.folder import PolicyFolder
from phyai_ray.models.lerobot_policy.memory import check_dtype
from phyai_ray.models.lerobot_policy.policy import LeRobotPolicy, build_network, expected_weights
from phyai_ray.models.lerobot_policy.processing import Normalizer
from phyai_ray.models.lerobot_policy.request import frame_layout
from phyai_ray.plugins.admission import CostBudget
from phyai_ray.plugins.entry import Entry
from phyai_ray.plugins.iteration import SequenceSpec
from phyai_ray.plugins.registry import register_plugin
from phyai_ray.stepwise.frames import FrameLayout, RobotFrame, parse_frame


DEFAULT_MAX_IMAGE_SIDE = 2048


@register_plugin
class LeRobotPolicyEntry(Entry):
    """LeRobot vision-language-action policies (SmolVLA, pi0, pi0.5), one expert denoising step per iteration."""

    name = "lerobot_policy"
    parallel_domains = frozenset()

    def __init__(self, plugin_args: dict[str, Any] | None = None) -> None:
        self.folder: PolicyFolder | None = None
        self.layout: FrameLayout | None = None
        if plugin_args:
            self.configure(plugin_args)

    def configure(self, plugin_args: dict[str, Any]) -> None:
        check_dtype(plugin_args.get("dtype"))
        folder = PolicyFolder.open(plugin_args)
        norm = Normalizer(folder)
        for kind, features in (("STATE", folder.features("STATE")), ("ACTION", folder.features("ACTION"))):
            if len(features) != 1:
                raise ValueError(f"lerobot_policy: {folder.path / 'config.json'} has {len(features)} {kind} features "
                                 f"({sorted(features)}); supported: exactly one")
            norm.check(next(iter(features)), kind)
        if not folder.features("VISUAL"):
            raise ValueError(f"lerobot_policy: {folder.path / 'config.json'} names no VISUAL input feature; "
                             "SmolVLA / pi0 need at least one camera")
        network = build_network(folder)
        folder.check_weights(expected_weights(network), getattr(network, "checkpoint_aliases", dict)())
        self._image_tokens, self._layers = network.image_tokens(), network.num_vlm_layers
        budget = plugin_args.get("max_prefix_cache", 2 ** 62)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f'lerobot_policy: plugin_args["max_prefix_cache"] must be an int >= 1 (prefix tokens x '
                             f"layers of the frames running together), got {budget!r}")
        self._cache_budget = budget
        self._batch_prefixes = plugin_args.get("batch_prefixes", True)
        if not isinstance(self._batch_prefixes, bool):
            raise ValueError(f'lerobot_policy: plugin_args["batch_prefixes"] must be true or false (one VLM pass for '
                             f"the frames admitted together, or one per frame), got {self._batch_prefixes!r}")
        self._dtype = plugin_args.get("dtype")
        budget = plugin_args.get("prefix_budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f'lerobot_policy: plugin_args["prefix_budget"] must be an int >= 1 (tokens x layers of '
                             f"prefix work per iteration) or null, got {budget!r}")
        self._prefix_budget = budget
        side = plugin_args.get("max_image_side", DEFAULT_MAX_IMAGE_SIDE)
        if isinstance(side, bool) or not isinstance(side, int) or side < 1:
            raise ValueError(f'lerobot_policy: plugin_args["max_image_side"] must be an int >= 1 (pixels), '
                             f"got {side!r}")
        self._max_side = side
        self.folder = folder
        self.layout = frame_layout(folder, plugin_args.get("openpi_keys"), plugin_args.get("openpi_format"))

    def _require(self) -> FrameLayout:
        if self.layout is None:
            raise ValueError('lerobot_policy needs plugin_args {"model": "<pretrained_model folder>", ...}')
        return self.layout

    def validate_request(self, request: Any) -> RobotFrame:
        """The checked frame (state size, cameras: 3 channels, at most max_image_side a side), or a
        refusal naming the field, the limit and the plugin_args key that changes it."""
        frame = parse_frame(request, self._require())
        for key, image in frame.images.items():
            height, width = image.shape[1:]
            if max(height, width) > self._max_side:
                cfg = self.folder.config
                raise ValueError(f"'{key}' is {height} x {width} pixels; this policy takes cameras up to "
                                 f"{self._max_side} pixels a side (plugin_args['max_image_side']; the checkpoint "
                                 f"resizes to {cfg.get('resize_imgs_with_padding') or cfg.get('image_resolution')})")
        return frame

    def sequences(self, request: Any) -> list[SequenceSpec]:
        """One sequence per frame; its cost is the KV cache it keeps while it runs: prefix tokens x layers;
        its steps the expert's denoising steps (with a deadline, finish-by admission runs the frame only
        if that many iterations of the replica's recent length end in time)."""
        payload = parse_frame(request, self._require())  # a checked frame passes as it is
        return [SequenceSpec(payload=payload, cost=self.prefix_cost(payload), steps=self.denoising_steps())]

    def denoising_steps(self) -> int:
        """The Euler steps of one frame, as policy.py runs them: SmolVLA's `num_steps`, pi0 / pi0.5's
        `num_inference_steps` (10 when the config leaves it out)."""
        self._require()
        cfg = self.folder.config
        return int(cfg.get("num_steps", 10) if self.folder.type == "smolvla" else cfg.get("num_inference_steps", 10))

    def prefix_cost(self, payload: RobotFrame) -> int:
        """(cameras x image tokens + prompt tokens + the state token) x VLM layers, the prompt counted
        at its longest (tokenizer_max_length) so the dispatcher need not tokenize."""
        cfg = self.folder.config
        text = int(cfg.get("tokenizer_max_length", 48)) + (1 if cfg["type"] == "smolvla" else 0)
        return (len(self.layout.cameras) * self._image_tokens + text) * self._layers

    def admission(self, batching: Any) -> CostBudget:
        """Up to max_num_seqs frames per expert step whose prefix caches (prefix tokens x layers each)
        fit plugin_args["max_prefix_cache"] together (unlimited by default); a frame always runs alone."""
        return CostBudget(batching.max_num_seqs, self._cache_budget)

    def gather(self, request: Any, outputs: list[Any]) -> dict[str, Any]:
        [out] = outputs
        if not isinstance(out, dict):
            raise RequestAbortedError("the frame was aborted before its last denoising step; send it again")
        return out

    def policy_metadata(self) -> dict[str, Any]:
        layout, cfg = self._require(), self.folder.config
        return {"policy": self.name, "type": cfg["type"], "cameras": sorted(layout.cameras),
                "state_key": layout.state_key, "state_dim": layout.state_dim, "action_dim": layout.action_dim,
                "action_horizon": layout.chunk,
                "num_steps": int(cfg.get("num_steps", cfg.get("num_inference_steps", 10))),  # smolvla / pi0, pi05
                "openpi_keys": layout.aliases,
                "real_time_chunking": ["prev_actions", "inference_delay", "execution_horizon"]}

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> LeRobotPolicy:
        if self.folder is None:
            self.configure(plugin_args)
        return LeRobotPolicy(self.folder, ctx, batch_prefixes=self._batch_prefixes, dtype=self._dtype,
                             prefix_budget=self._prefix_budget)
