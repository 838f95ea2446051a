"""pi0 and pi0.5 (LeRobot `type: pi0` / `pi05`): PaliGemma's prefix, a Gemma action expert, as LeRobot 0.4.4.

    prefix  = [SigLIP(image_c) -> projector] per camera + [token embeddings * sqrt(width)]
              (pi0.5: the state is written into the prompt as 256-bin integers); all tokens see each other
    cache   = per Gemma layer its keys (rotated) and values: computed once per frame, the frames admitted
              together in ONE pass (right-padded, masked)
    step    = the expert (a narrower Gemma, same heads and depth) over the suffix, attending to the
              prefix cache and to the suffix: pi0: [state_proj(state)] + action tokens
              (action_in_proj(x_t) ++ sin-cos(time) -> mlp); pi0.5: action tokens only, the time's
              mlp conditioning every RMSNorm of the expert (scale, shift, gate: adaptive RMSNorm and
              gated residuals) -> norm -> action_out_proj on the chunk's tokens = v
              x_{t+dt} = x_t + dt * v, dt = -1 / num_steps, time from 1 down to 0

Sizes follow LeRobot's variant names (gemma_2b, gemma_300m; SigLIP so400m) unless plugin_args["sizes"]
gives them: {"paligemma": {width, depth, mlp_dim, num_heads, num_kv_heads, head_dim}, "action_expert":
{...}, "vision": {hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, patch_size},
"vocab_size": n}. Parameter names are the checkpoint's own (`model.paligemma_with_expert...`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Generator

import numpy as np
import torch
from torch import nn

from phyai_ray.models.lerobot_policy.layers import att_2d_masks, attend, pad_mask, run_steps, \
    stack_right, time_embedding
from phyai_ray.models.lerobot_policy.slots import SlotView
from phyai_ray.nn.norm import GemmaRMSNorm
from phyai_ray.nn.rotary import gemma_rope

VARIANTS = {
    "gemma_2b": {"width": 2048, "depth": 18, "mlp_dim": 16384, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
    "gemma_300m": {"width": 1024, "depth": 18, "mlp_dim": 4096, "num_heads": 8, "num_kv_heads": 1, "head_dim": 256},
}
SIGLIP = {"hidden_size": 1152, "num_hidden_layers": 27, "num_attention_heads": 16, "intermediate_size": 4304,
          "patch_size": 14}
GEMMA_FIELDS = ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")


def pi_sizes(config: dict[str, Any], given: dict[str, Any] | None) -> dict[str, Any]:
    """The model sizes: `given` (plugin_args["sizes"], every field checked) or the config's variants."""
    if given:
        for part, fields in (("paligemma", GEMMA_FIELDS), ("action_expert", GEMMA_FIELDS), ("vision", tuple(SIGLIP))):
            missing = [f for f in fields if not isinstance((given.get(part) or {}).get(f), int)]
            if missing:
                raise ValueError(f'lerobot_policy: plugin_args["sizes"]["{part}"] lacks the ints {missing}; '
                                 f"it needs {list(fields)}")
        if not isinstance(given.get("vocab_size"), int):
            raise ValueError('lerobot_policy: plugin_args["sizes"] needs "vocab_size" (an int)')
        return given
    out = {}
    for part, key in (("paligemma", "paligemma_variant"), ("action_expert", "action_expert_variant")):
        name = config.get(key, "gemma_2b" if part == "paligemma" else "gemma_300m")
        if name not in VARIANTS:
            raise ValueError(f"lerobot_policy: {key}={name!r}; supported: {sorted(VARIANTS)} or plugin_args['sizes']")
        out[part] = VARIANTS[name]
    return {**out, "vision": SIGLIP, "vocab_size": 257152}


def gated(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


class GemmaLayer(nn.Module):
    def __init__(self, s: dict[str, int], cond_dim: int | None) -> None:
        super().__init__()
        w, h, kv, d = s["width"], s["num_heads"], s["num_kv_heads"], s["head_dim"]
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(w, h * d, bias=False)
        self.self_attn.k_proj = nn.Linear(w, kv * d, bias=False)
        self.self_attn.v_proj = nn.Linear(w, kv * d, bias=False)
        self.self_attn.o_proj = nn.Linear(h * d, w, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(w, s["mlp_dim"], bias=False)
        self.mlp.up_proj = nn.Linear(w, s["mlp_dim"], bias=False)
        self.mlp.down_proj = nn.Linear(s["mlp_dim"], w, bias=False)
        self.input_layernorm = GemmaRMSNorm(w, cond_dim)
        self.post_attention_layernorm = GemmaRMSNorm(w, cond_dim)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, d: int, cond: torch.Tensor | None):
        h, gate = self.input_layernorm(x, cond)
        shape = (*x.shape[:2], -1, d)
        q = gemma_rope(self.self_attn.q_proj(h).view(shape), positions)
        k = gemma_rope(self.self_attn.k_proj(h).view(shape), positions)
        return q, k, self.self_attn.v_proj(h).view(shape), gate

    def finish(self, x: torch.Tensor, att: torch.Tensor, gate: Any, cond: torch.Tensor | None) -> torch.Tensor:
        out = gated(x, self.self_attn.o_proj(att), gate)
        h, gate2 = self.post_attention_layernorm(out, cond)
        m = self.mlp.down_proj(nn.functional.gelu(self.mlp.gate_proj(h), approximate="tanh") * self.mlp.up_proj(h))
        return gated(out, m, gate2)


@dataclass
class Prefix:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int


class PiZero(nn.Module):
    """pi0 / pi0.5 under LeRobot's parameter names (see the module docstring)."""

    def __init__(self, config: dict[str, Any], sizes: dict[str, Any]) -> None:
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        self.cfg, self.pi05 = config, config["type"] == "pi05"
        sizes = pi_sizes(config, sizes)
        self.pg, self.ex = sizes["paligemma"], sizes["action_expert"]
        if (self.pg["depth"], self.pg["num_heads"], self.pg["head_dim"]) != \
                (self.ex["depth"], self.ex["num_heads"], self.ex["head_dim"]):
            raise ValueError(f"lerobot_policy: the PaliGemma and expert sizes must share depth, num_heads and "
                             f"head_dim, got {self.pg} and {self.ex}")
        image = int((config.get("image_resolution") or [224])[0])
        vision = SiglipVisionConfig(**sizes["vision"], image_size=image, hidden_act="gelu_pytorch_tanh",
                                    layer_norm_eps=1e-6, vision_use_head=False)
        pwe = self.paligemma_with_expert = nn.Module()
        pwe.paligemma = nn.Module()
        pg = pwe.paligemma.model = nn.Module()
        pg.vision_tower = nn.Module()
        pg.vision_tower.vision_model = SiglipVisionModel(vision)
        pg.multi_modal_projector = nn.Module()
        pg.multi_modal_projector.linear = nn.Linear(sizes["vision"]["hidden_size"], self.pg["width"])
        pg.language_model = nn.Module()
        pg.language_model.embed_tokens = nn.Embedding(sizes["vocab_size"], self.pg["width"])
        pg.language_model.layers = nn.ModuleList(GemmaLayer(self.pg, None) for _ in range(self.pg["depth"]))
        cond = self.ex["width"] if self.pi05 else None
        pwe.gemma_expert = nn.Module()
        expert = pwe.gemma_expert.model = nn.Module()
        expert.layers = nn.ModuleList(GemmaLayer(self.ex, cond) for _ in range(self.ex["depth"]))
        expert.norm = GemmaRMSNorm(self.ex["width"], cond)
        w, a = self.ex["width"], int(config["max_action_dim"])
        self.action_in_proj = nn.Linear(a, w)
        self.action_out_proj = nn.Linear(w, a)
        if self.pi05:
            self.time_mlp_in, self.time_mlp_out = nn.Linear(w, w), nn.Linear(w, w)
        else:
            self.state_proj = nn.Linear(int(config["max_state_dim"]), w)
            self.action_time_mlp_in, self.action_time_mlp_out = nn.Linear(2 * w, w), nn.Linear(w, w)

    def image_tokens(self) -> int:
        """Prefix tokens per camera: SigLIP's patches of the resized image."""
        emb = self.paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings
        return emb.num_patches

    @property
    def num_vlm_layers(self) -> int:
        return self.pg["depth"]

    @staticmethod
    def checkpoint_aliases() -> dict[str, str]:
        """Tensors a checkpoint may store under a tied name: the embedding is PaliGemma's lm_head."""
        p = "model.paligemma_with_expert.paligemma."
        return {p + "model.language_model.embed_tokens.weight": p + "lm_head.weight"}

    def unused_weights(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{name: (shape, why)} of the tensors a LeRobot pi0 / pi0.5 checkpoint holds that the action path
        never reads: the expert's token head and PaliGemma's final norm (the prefix is read as keys and
        values of each layer, never as its last hidden state)."""
        p = "model.paligemma_with_expert."
        vocab = self.paligemma_with_expert.paligemma.model.language_model.embed_tokens.num_embeddings
        return {p + "gemma_expert.lm_head.weight": ((vocab, self.ex["width"]), "the action expert's token head: "
                                                    "the expert decodes actions, never tokens"),
                p + "paligemma.model.language_model.norm.weight": ((self.pg["width"],), "PaliGemma's final norm: "
                                                                   "the prefix is read as keys and values only")}

    @staticmethod
    def state_prompt(task: str, state: torch.Tensor) -> str:
        """pi0.5's prompt: the normalized, padded state as 256-bin integers after the cleaned task."""
        bins = np.digitize(state.cpu().numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
        cleaned = task.strip().replace("_", " ").replace("\n", " ")
        return f"Task: {cleaned}, State: {' '.join(map(str, bins))};\nAction: "

    # -- the prefix, once per frame: the frames admitted together in one forward -----------------------
    @torch.inference_mode()
    def encode_prefixes(self, images: list[list[torch.Tensor]], tokens: list[torch.Tensor],
                        states: torch.Tensor) -> list[Prefix]:
        """B frames' prefix caches from ONE pass (`prefix_steps` run to its end)."""
        return run_steps(self.prefix_steps(images, tokens, states))

    def prefix_steps(self, images: list[list[torch.Tensor]], tokens: list[torch.Tensor],
                     states: torch.Tensor) -> Generator[int, None, list[Prefix]]:
        """B frames' prefix caches from ONE pass, one layer at a time: yields each layer's work (tokens
        through it) after running it, returns the caches. images[b] the frame's cameras [3, H, W]
        (resized, in [-1, 1]), tokens[b] its prompt [T_b] (pi0.5's holds the state; `states` unused).

        Frame b's prefix is [its cameras' SigLIP tokens, in camera order] ++ [its prompt], L_b tokens,
        all seeing each other. Prompts differ in length, so the rows are padded on the right to L_max:
        a padded key is masked out of every real token's attention and its positions run on 0..L_b-1,
        so row b computes what frame b alone computes; its cache is cut back to L_b afterwards. The
        cameras of one size go through SigLIP together, layer by layer.
        """
        pg = self.paligemma_with_expert.paligemma.model
        flat = yield from self._vision_steps([img for frame in images for img in frame])
        embed, rows, at = pg.language_model.embed_tokens, [], 0
        for frame, ids in zip(images, tokens):
            lang = embed(ids)
            rows.append(torch.cat([*flat[at:at + len(frame)], lang * math.sqrt(lang.shape[-1])]))
            at += len(frame)
        lengths = [r.shape[0] for r in rows]
        lmax, dev = max(lengths), rows[0].device
        x = stack_right(rows, lmax)
        real = pad_mask(lengths, lmax, dev)
        mask = real[:, None, :] & real[:, :, None]
        pos = torch.arange(lmax, device=dev)[None].expand(len(rows), lmax)
        keys, values = [], []
        d = self.pg["head_dim"]
        for layer in pg.language_model.layers:
            q, k, v, gate = layer.qkv(x, pos, d, None)
            keys.append(k)
            values.append(v)
            x = layer.finish(x, attend(q, k, v, mask), gate, None)
            yield len(rows) * lmax
        return [Prefix([k[b, :n].clone() for k in keys], [v[b, :n].clone() for v in values], n)
                for b, n in enumerate(lengths)]

    def _vision_steps(self, images: list[torch.Tensor]) -> Generator[int, None, list[torch.Tensor]]:
        """SigLIP + the projector over the cameras, one group of one image size and one layer at a time
        (what `SiglipVisionModel` computes: embeddings, encoder layers, post_layernorm); each camera's
        tokens, in the given order."""
        tower = self.paligemma_with_expert.paligemma.model.vision_tower.vision_model
        project = self.paligemma_with_expert.paligemma.model.multi_modal_projector.linear
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, img in enumerate(images):
            groups.setdefault(tuple(img.shape), []).append(i)
        out: list[Any] = [None] * len(images)
        for members in groups.values():
            h = tower.embeddings(torch.stack([images[i] for i in members]))
            for layer in tower.encoder.layers:
                h = layer(h, None)
                yield h.shape[0] * h.shape[1]
            for i, row in zip(members, project(tower.post_layernorm(h))):
                out[i] = row
        return out

    # -- one expert step for a stack of frames --------------------------------------------------------
    def _suffix(self, x: torch.Tensor, time: torch.Tensor, states: torch.Tensor | None):
        w = self.ex["width"]
        temb = time_embedding(time, w, float(self.cfg.get("min_period", 4e-3)),
                              float(self.cfg.get("max_period", 4.0))).to(torch.float32)
        action = self.action_in_proj(x)
        if self.pi05:
            cond = nn.functional.silu(self.time_mlp_out(nn.functional.silu(self.time_mlp_in(temb))))
            return action, cond, [1] + [0] * (x.shape[1] - 1)
        h = torch.cat([action, temb[:, None, :].expand_as(action)], dim=2)
        h = self.action_time_mlp_out(nn.functional.silu(self.action_time_mlp_in(h)))
        h = torch.cat([self.state_proj(states)[:, None, :], h], dim=1)
        return h, None, [1, 1] + [0] * (x.shape[1] - 1)

    @torch.inference_mode()
    def velocity(self, prefixes: SlotView, x: torch.Tensor, time: torch.Tensor,
                 states: torch.Tensor | None = None) -> torch.Tensor:
        """v for B frames: x [B, chunk, max_action_dim], time [B], states [B, max_state_dim] (pi0)."""
        b, chunk = x.shape[:2]
        h, cond, att = self._suffix(x, time, states)
        s, dev = h.shape[1], x.device
        lengths, lmax = prefixes.lengths, prefixes.lmax
        suffix_mask = att_2d_masks(torch.ones(b, s, dtype=torch.bool, device=dev),
                                   torch.tensor(att, device=dev)[None].expand(b, s))
        mask = torch.cat([pad_mask(lengths, lmax, dev)[:, None, :].expand(b, s, lmax), suffix_mask], dim=2)
        pos = torch.tensor(lengths, device=dev)[:, None] + torch.arange(s, device=dev)[None]
        d = self.ex["head_dim"]
        expert = self.paligemma_with_expert.gemma_expert.model
        for i, layer in enumerate(expert.layers):
            q, k, v, gate = layer.qkv(h, pos, d, cond)
            k = torch.cat([prefixes.get("k", i), k], dim=1)
            v = torch.cat([prefixes.get("v", i), v], dim=1)
            h = layer.finish(h, attend(q, k, v, mask), gate, cond)
        h, _ = expert.norm(h, cond)
        return self.action_out_proj(h[:, -chunk:].to(torch.float32))
