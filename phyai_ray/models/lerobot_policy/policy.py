"""One rank of a LeRobot policy: the iteration protocol, ONE action-expert Euler step per iteration.

    admit(frame)    preprocess (normalize the state, resize the cameras, tokenize the task); the
                    frame's noise becomes x at time 1; its prefix waits for the coming iteration
                    (several admits come before one iterate: the frames of one plan)
    iterate()       the prefixes of the frames admitted since the last iteration run through the
                    VLM in ONE batched pass (right-padded, masked; see `_encode`), each frame keeping
                    its KV cache (and SmolVLA's projected cross-attention K/V). Then every running
                    frame of every robot takes its next step in ONE expert forward:
                    each prefix read in place from its slot (slots.py: written once, freed with
                    its chunk) with pad masks, each frame at its own time
                    (1 + j * dt), RTC per robot; a frame whose last step this was ends with its
                    actions, sliced to the real action dim and unnormalized
    drop / recompute   forget a frame / start it again from its noise (after a weight update)
    sleep / wake_up    level 1: the prefix pool's spare slots freed, the weights to the host on CUDA;
                       level 2: the weights dropped, refilled by the next update (memory.py)

The network serves in memory.py's dtype (bfloat16 on CUDA by default, float32 on CPU). A whole
model.safetensors is accepted as an update: the tensors the action path never reads (a token head,
the VLM's final norm) are skipped and named in the update's report (`weight_note`).

A frame that arrives while others run joins at the next iteration; its rows never mix with another
frame's, so a robot's chunk is the same alone or batched (to float rounding). With
plugin_args["batch_prefixes"] false, each admitted frame's prefix runs alone (one VLM pass per frame):
the same numbers, kept to measure what batching the prefixes buys.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from phyai_ray.models.lerobot_policy.folder import PolicyFolder
from phyai_ray.models.lerobot_policy.joins import PrefixPhase
from phyai_ray.models.lerobot_policy.slots import PrefixSlots
from phyai_ray.models.lerobot_policy.memory import checkpoint_tensors, compute, drop_weights, move_weights, \
    serving_dtype, tensor_bytes
from phyai_ray.models.lerobot_policy.processing import Normalizer, PromptTokenizer, pad_vector, resize_with_pad, \
    resize_with_pad_centered
from phyai_ray.plugins.iteration import Delta
from phyai_ray.stepwise.frames import RobotFrame
from phyai_ray.stepwise.rtc import Guidance, GuidanceBatch, RTCRule
from phyai_ray.stepwise.sequence import Running, Sequence


def build_network(folder: PolicyFolder, device: Any = "meta") -> torch.nn.Module:
    """The policy's network under LeRobot's parameter names, on `device` (meta: shapes only, no memory)."""
    with torch.device(device):
        if folder.type == "smolvla":
            from phyai_ray.models.lerobot_policy.smolvla import SmolVLA

            return SmolVLA(folder.config, folder.backbone)
        from phyai_ray.models.lerobot_policy.pi0 import PiZero

        return PiZero(folder.config, folder.sizes)


def expected_weights(network: torch.nn.Module) -> dict[str, torch.Size]:
    """{checkpoint name: shape} the network loads ("model." + its own parameter names)."""
    return {f"model.{k}": v.shape for k, v in network.state_dict().items()}


class Stacked:
    """What one expert batch reads every step besides its prefixes (those stay in their slots:
    slots.py), stacked once while the same frames run: states and RTC guidance (on the device)."""

    def __init__(self, frames: list, device: torch.device) -> None:
        self.frames = frames  # held, so no other frame takes one of their ids while this stack is in use
        self.states = torch.stack([f.state for f in frames])
        self.guidance = GuidanceBatch([f.guidance for f in frames], device)

    def held(self) -> list[torch.Tensor]:
        return [self.states]


@dataclass(eq=False, kw_only=True)
class Expert(Sequence):
    """One frame on its way (`value`: its sample [chunk, max_action_dim] after `index` Euler steps): its
    prefix cache (None until its prefix pass; `inputs` hold the resized cameras and the prompt's tokens
    until then) and RTC guidance."""

    frame: RobotFrame
    prefix: Any = None
    inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None
    guidance: Guidance | None = None
    state: torch.Tensor | None = None  # normalized, padded to max_state_dim (pi0's suffix takes it)
    slot: int | None = None  # its prefix's slot in the rank's pool (slots.py), from its first step on


class LeRobotPolicy:
    """The per-rank model of `lerobot_policy` (see the module docstring)."""

    def __init__(self, folder: PolicyFolder, ctx: Any, batch_prefixes: bool = True, dtype: str | None = None,
                 prefix_budget: int | None = None) -> None:
        self.folder, self.ctx, self.batch_prefixes = folder, ctx, batch_prefixes
        self.device = torch.device(getattr(ctx, "device", "cpu") or "cpu")
        cfg = folder.config
        self.dtype = serving_dtype(cfg, self.device, dtype)
        net = build_network(folder, self.device)
        weights = folder.load_weights("model.")
        for name, stored in getattr(net, "checkpoint_aliases", dict)().items():
            weights.setdefault(name.removeprefix("model."), weights.get(stored.removeprefix("model.")))
        net.load_state_dict({k: weights[k] for k in net.state_dict()})
        del weights
        self.net = net.to(dtype=self.dtype).eval()
        self._specs = {f"model.{k}": (tuple(v.shape), v.dtype) for k, v in self.net.state_dict().items()}
        self._unused: dict[str, tuple[tuple[int, ...], str]] = getattr(self.net, "unused_weights", dict)()
        self.chunk, self.num_steps = int(cfg["chunk_size"]), int(cfg.get("num_steps", 10))
        self.max_state, self.max_action = int(cfg["max_state_dim"]), int(cfg["max_action_dim"])
        self.kind = folder.type
        self.resize = cfg.get("resize_imgs_with_padding") if self.kind == "smolvla" else cfg.get("image_resolution")
        if self.kind != "smolvla":
            self.num_steps = int(cfg.get("num_inference_steps", 10))
        self.norm = Normalizer(folder)
        self.tokenizer = PromptTokenizer(folder.backbone, int(cfg.get("tokenizer_max_length", 48)))
        self.rtc = RTCRule.lerobot(cfg.get("rtc_config"))
        self.state_key = next(iter(folder.features("STATE")))
        self.cameras = list(folder.features("VISUAL"))
        [(self.action_key, (self.action_dim, *_))] = folder.features("ACTION").items()
        self.running: Running[Expert] = Running()
        self.joins = PrefixPhase(self.net, prefix_budget, batch_prefixes)
        self.prefix_passes: Counter[int] = self.joins.passes  # {frames in one VLM prefix pass: how many such passes}
        self._stacked: tuple[tuple[int, ...], Stacked] | None = None
        self.slots = PrefixSlots()  # each running frame's prefix cache, written once at its first step
        self.weight_version: Any = None

    # -- the iteration protocol -----------------------------------------------------------------
    @torch.inference_mode()
    def admit(self, ident: int, payload: RobotFrame) -> None:
        self.running.admit(ident, self._start(payload))

    def drop(self, ident: int) -> None:
        self.running.drop(ident)
        self._free_slots()

    @torch.inference_mode()
    def recompute(self, ident: int) -> None:
        """Start the frame again from its noise; its prefix runs again (with this plan's admissions)."""
        if ident in self.running:
            self.running.admit(ident, self._start(self.running[ident].frame))
            self._free_slots()

    @torch.inference_mode()
    def iterate(self) -> dict[int, Delta]:
        """The new frames' prefixes in one pass, then ONE Euler step of the action expert for every
        running frame (see the module docstring)."""
        deltas = self.running.iterate(self._encode_and_advance, lambda f: {"actions": self._postprocess(f.value)})
        self._free_slots()
        if not len(self.running):
            self._stacked = None  # the fleet left: nothing stacked held while idle
        return deltas

    def _free_slots(self) -> None:
        """The prefix slots of frames no longer running go back to the pool (the pool itself when none
        is left in use)."""
        self.slots.keep([self.running[i] for i in self.running])

    def _encode_and_advance(self, frames: list[Expert]) -> None:
        """The prefix phase (joins.py: whole, or within plugin_args["prefix_budget"]), then one step of
        every frame whose prefix is ready."""
        with compute(self.device, self.dtype):
            self.joins.run([f for f in frames if f.prefix is None])
            ready = [f for f in frames if f.prefix is not None]
            if ready:
                self._advance(ready)

    @torch.inference_mode()
    def step(self, payload: RobotFrame) -> dict[str, torch.Tensor]:
        """A whole frame alone: every step of one frame (the same math as per iteration)."""
        [frame] = self.encode([payload])
        with compute(self.device, self.dtype):
            while not frame.done:
                self._advance([frame])
        self._free_slots()
        return {"actions": self._postprocess(frame.value)}

    def prefix_stats(self) -> dict[int, int]:
        """{frames in one VLM prefix pass: passes of that size} since this rank started (collective_rpc)."""
        return dict(self.prefix_passes)

    # -- weight updates by the checkpoint's own names ----------------------------------------------
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """{"model.action_out_proj.weight": (shape, dtype), ...}: model.safetensors' names, checked
        (names, shapes, dtypes) before any tensor of an update changes."""
        specs = dict(self._specs)  # recorded at start: sleep(level=2) empties the tensors, not their specs
        for name, stored in getattr(self.net, "checkpoint_aliases", dict)().items():
            specs[stored] = specs[name]  # a tied tensor: either of its names
        return specs

    def weight_note(self, name: str, shape: tuple[int, ...], dtype: str) -> str | None:
        """Why a tensor outside `weight_specs` is accepted (the update's report lists it), or None to
        refuse it: a checkpoint tensor the action path never reads, at its checkpoint shape, is skipped;
        a known tensor in another floating dtype is cast (a float32 checkpoint to a bfloat16 rank)."""
        if name in self._unused and tuple(shape) == self._unused[name][0]:
            return f"skipped ({self._unused[name][1]})"
        want = self.weight_specs().get(name)
        if want is not None and want[0] == tuple(shape) and dtype in ("float32", "bfloat16", "float16", "float64"):
            return f"cast from {dtype} to {str(want[1]).removeprefix('torch.')} on receive"
        return None

    @torch.no_grad()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into the parameter of that checkpoint name (cast to the serving dtype; a
        tensor sleep(level=2) emptied gets storage of its own again); the skipped ones (`weight_note`)
        are left out. Running frames are rebuilt by the loop (`recompute`) before their next step, so
        no prefix cache of the old weights is used."""
        own = checkpoint_tensors(self.net)
        tied = {stored: name for name, stored in getattr(self.net, "checkpoint_aliases", dict)().items()}
        for name, tensor in weights:
            key = tied.get(name, name).removeprefix("model.")
            if key not in own:
                continue  # checked before: a tensor the action path never reads
            target = own[key]
            source = tensor.to(device=self.device, dtype=target.dtype)
            if target.numel() == 0 and source.numel():
                target.data = source.clone()
            else:
                target.copy_(source)
        self._stacked = None
        self.joins.reset()

    # -- sleep / wake (C2: the bytes freed on this rank, host and device) -------------------------------
    def sleep(self, level: int) -> int:
        """Level 1: the prefix pool's spare slots and the stacked states freed and, on CUDA, the weights moved to the host; level 2:
        the weights dropped as well (the next weight update refills them). The bytes freed."""
        freed = self.reset_cache()
        self.joins.reset()
        if level >= 2:
            return freed + drop_weights(self.net)
        if self.device.type == "cuda":
            freed += move_weights(self.net, "cpu")
        return freed

    def wake_up(self, tags: list[str]) -> None:
        """"weights": the weights a level-1 sleep moved to the host back on the device (dropped ones
        wait for an update); "kv_cache": the prefix pool shrunk to its slots in use (nothing else is kept between frames)."""
        if "weights" in tags:
            move_weights(self.net, self.device)
        if "kv_cache" in tags:
            self.reset_cache()

    def reset_cache(self) -> int:
        """Forget the last expert batch's stacked states and guidance (rebuilt at the next step) and the
        prefix pool's slots no running frame holds; the bytes freed."""
        held, self._stacked = self._stacked, None
        freed = self.slots.shrink()
        if held is None:
            return freed
        return freed + tensor_bytes(held[1].held())

    # -- the math -------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, payloads: list[RobotFrame]) -> list[Expert]:
        """Frames ready for their first step, their prefixes from ONE VLM pass (see `_encode`)."""
        frames = [self._start(p) for p in payloads]
        with compute(self.device, self.dtype):
            self._encode(frames)
        return frames

    def _encode(self, frames: list[Expert]) -> None:
        """The frames' prefix caches, whole: ONE pass of the VLM over all of them (or one pass per frame
        with batch_prefixes off); counted in `prefix_passes` by frames per pass."""
        whole = PrefixPhase(self.net, None, self.batch_prefixes)
        whole.run(frames)
        self.prefix_passes.update(whole.passes)

    def _start(self, payload: RobotFrame) -> Expert:
        """The frame at time 1, preprocessed as LeRobot does (its prefix not yet run): the state
        normalized and padded, the cameras resized to [-1, 1], the prompt tokenized; its noise (given,
        or drawn from its seed) and its RTC guidance (in the model's normalized action space)."""
        dev = self.device
        state = self.norm.apply(payload.state.to(dev), self.state_key, "STATE")
        state = pad_vector(state, self.max_state)
        images = []
        for key in self.cameras:
            img = payload.images[key].to(dev)[None]
            if self.kind == "smolvla" and self.resize:
                img = resize_with_pad(img, *self.resize, pad_value=0)
            elif self.resize:
                img = resize_with_pad_centered(img, *self.resize)
            images.append(img[0] * 2.0 - 1.0)
        if self.kind == "pi05":
            tokens = self.tokenizer(self.net.state_prompt(payload.task, state), newline=False)
        else:
            tokens = self.tokenizer(payload.task)
        noise = payload.noise
        if noise is None:
            gen = torch.Generator(device="cpu").manual_seed(payload.noise_seed)
            noise = torch.randn(self.chunk, self.max_action, generator=gen)
        guidance = None
        if payload.prev_actions is not None:
            model_space = self.norm.apply(payload.prev_actions.to(dev), self.action_key, "ACTION")
            guidance = Guidance.build(self.rtc, model_space, payload.inference_delay, payload.execution_horizon,
                                      self.chunk, self.max_action, dev)
        return Expert(value=noise.to(dev, torch.float32).clone(), steps=self.num_steps, frame=payload,
                      inputs=(images, tokens.to(dev)), guidance=guidance, state=state)

    def _advance(self, frames: list[Expert]) -> None:
        """ONE Euler step of every frame, LeRobot's time running from 1 (noise) to 0 (actions): one
        expert forward and batched RTC for the whole batch: each frame's prefix read from its slot
        (written there at its first step), states and guidance stacked once per batch."""
        dt = -1.0 / self.num_steps
        for frame in frames:
            self.slots.place(frame)
        key = tuple(id(f) for f in frames)
        if self._stacked is None or self._stacked[0] != key:  # the batch changed: stack its inputs anew
            self._stacked = (key, Stacked(frames, self.device))
        stacked = self._stacked[1]
        times = torch.tensor([1.0 + f.index * dt for f in frames], dtype=torch.float32, device=self.device)
        x = torch.stack([f.value for f in frames])
        v = self.net.velocity(self.slots.view(frames), x, times, stacked.states)
        v = -stacked.guidance.velocity(x, -v, times)  # rtc.py's velocity points toward the actions: LeRobot's is -it
        for frame, row in zip(frames, x + dt * v):
            frame.took(row)

    def _postprocess(self, x: torch.Tensor) -> torch.Tensor:
        actions = x[:, :self.action_dim]
        return self.norm.apply(actions, self.action_key, "ACTION", inverse=True).cpu()
