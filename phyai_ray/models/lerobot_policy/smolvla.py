"""SmolVLA (LeRobot `type: smolvla`) on transformers 5's SmolVLM and Llama building blocks.

    prefix  = [SigLIP(image_c) -> pixel shuffle -> projection, * sqrt(d)] per camera
              + [token embeddings * sqrt(d)] + [state_proj(state)]        attends: images+language
                                                                           both ways, the state all
    cache   = per VLM layer (the first num_vlm_layers of SmolVLM's text model) its keys (rotated)
              and values: computed once per frame, the frames admitted together in ONE pass
              (right-padded, masked)
    cross   = per cross-attention layer, the expert's k_proj / v_proj of that layer's cached keys
              and values: also once per frame (LeRobot recomputes them every step)
    step    = the expert (a narrower Llama) over the chunk's action tokens:
              action_in_proj(x_t) ++ sin-cos(time) -> mlp -> layers -> norm -> action_out_proj = v
              even layers (self_attn_every_n_layers) attend to the prefix cache and causally to
              the chunk, the others cross-attend to the projected prefix
              x_{t+dt} = x_t + dt * v, dt = -1 / num_steps, time from 1 down to 0

The module tree mirrors LeRobot's, so parameter names are the checkpoint's own
(`model.vlm_with_expert.lm_expert.layers.0.self_attn.q_proj.weight`, ...): weights load and update by name.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phyai_ray.models.lerobot_policy.layers import att_2d_masks, attend, by_shape, pad_mask, \
    stack_right, time_embedding
from phyai_ray.models.lerobot_policy.slots import SlotView
from phyai_ray.nn.rotary import float32_rope


def expert_intermediate(hidden: int, multiplier: int = 4, multiple_of: int = 256) -> int:
    hidden = int(multiplier * int(2 * hidden / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class Prefix:
    """One frame's encoded prefix: per VLM layer (keys, values) [L, KV, D], per cross layer the
    expert's projections of them, and its length L."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cross: dict[int, tuple[torch.Tensor, torch.Tensor]]
    length: int


class _VLM(nn.Module):
    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer

        self.model = nn.Module()
        self.model.vision_model = SmolVLMVisionTransformer(config.vision_config)
        self.model.connector = SmolVLMConnector(config)
        text = AutoModel.from_config(config.text_config)
        if num_layers > 0:
            text.layers = text.layers[:num_layers]
        self.model.text_model = text


class SmolVLA(nn.Module):
    """The SmolVLA network under LeRobot's parameter names (see the module docstring)."""

    def __init__(self, config: dict[str, Any], vlm_folder: Path) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel

        self.cfg = config
        if config.get("attention_mode", "cross_attn") not in ("cross_attn", "self_attn"):
            raise ValueError(f"lerobot_policy: smolvla attention_mode={config.get('attention_mode')!r}; "
                             "supported: cross_attn, self_attn")
        extras = config.get("add_image_special_tokens"), config.get("empty_cameras", 0), config.get("prefix_length", -1)
        if extras[0] or extras[1] or extras[2] > 0:
            raise ValueError("lerobot_policy: smolvla with add_image_special_tokens, empty_cameras or prefix_length "
                             "> 0 is not supported; supported: the defaults (False, 0, -1)")
        vlm_config = AutoConfig.from_pretrained(str(vlm_folder), local_files_only=True)
        text = vlm_config.text_config
        self.kv_heads = text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.hidden = text.hidden_size
        self.vlm_with_expert = nn.Module()
        self.vlm_with_expert.vlm = _VLM(vlm_config, int(config.get("num_vlm_layers", -1)))
        self.num_vlm_layers = len(self.vlm_with_expert.vlm.model.text_model.layers)
        expert_config = copy.deepcopy(text)
        width = int(text.hidden_size * float(config.get("expert_width_multiplier", 0.75)))
        expert_config.hidden_size = width
        expert_config.intermediate_size = expert_intermediate(width)
        expert_config.head_dim = self.head_dim
        num_expert = int(config.get("num_expert_layers", -1))
        expert_config.num_hidden_layers = num_expert if num_expert > 0 else self.num_vlm_layers
        if self.num_vlm_layers % expert_config.num_hidden_layers:
            raise ValueError(f"lerobot_policy: num_vlm_layers={self.num_vlm_layers} is not a multiple of "
                             f"num_expert_layers={num_expert}")
        expert = AutoModel.from_config(expert_config)
        expert.embed_tokens = None
        self.every = int(config.get("self_attn_every_n_layers", 2))
        self.cross_mode = "cross" in config.get("attention_mode", "cross_attn")
        for i, layer in enumerate(expert.layers):
            if self.cross_mode and not (self.every > 0 and i % self.every == 0):
                kv_in, kv_out = self.kv_heads * self.head_dim, expert_config.num_key_value_heads * self.head_dim
                layer.self_attn.k_proj = nn.Linear(kv_in, kv_out, bias=expert_config.attention_bias)
                layer.self_attn.v_proj = nn.Linear(kv_in, kv_out, bias=expert_config.attention_bias)
        self.vlm_with_expert.lm_expert = expert
        self.width = width
        max_state, max_action = int(config["max_state_dim"]), int(config["max_action_dim"])
        self.state_proj = nn.Linear(max_state, self.hidden)
        self.action_in_proj = nn.Linear(max_action, width)
        self.action_out_proj = nn.Linear(width, max_action)
        self.action_time_mlp_in = nn.Linear(width * 2, width)
        self.action_time_mlp_out = nn.Linear(width, width)
        multiple = self.num_vlm_layers // expert_config.num_hidden_layers
        self.expert_at = [None if multiple > 0 and i > 0 and i % multiple else expert.layers[i // multiple]
                          for i in range(self.num_vlm_layers)]

    def image_tokens(self) -> int:
        """Prefix tokens per camera: the resized image's patches after the pixel shuffle."""
        vision = self.vlm_with_expert.vlm.model.vision_model.embeddings
        size = (self.cfg.get("resize_imgs_with_padding") or [vision.image_size])[0]
        scale = self.vlm_with_expert.vlm.model.connector.scale_factor
        return (size // vision.patch_size) ** 2 // scale ** 2

    def unused_weights(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{name: (shape, why)} of the tensors a LeRobot SmolVLA checkpoint holds that the action path never
        reads: the VLM's token head (tied to its embedding in SmolVLM; the policy decodes no tokens)."""
        embed = self.vlm_with_expert.vlm.model.text_model.get_input_embeddings()
        return {"model.vlm_with_expert.vlm.lm_head.weight": (tuple(embed.weight.shape), "the VLM's token head: "
                                                              "the policy decodes actions, never tokens")}

    def _is_self_attn(self, i: int) -> bool:
        return not self.cross_mode or (self.every > 0 and i % self.every == 0)

    def _vision(self, pixels: torch.Tensor) -> torch.Tensor:
        """SmolVLM's vision tower on [1, 3, h, w], with the patch positions of transformers 4.5x, which
        SmolVLA checkpoints were trained with and LeRobot 0.4.4 runs: fractional coordinates i / n * (1 - 1e-6)
        (transformers 5 clamps i / n instead, which moves every patch but the first to the next bucket)."""
        tower = self.vlm_with_expert.vlm.model.vision_model
        emb = tower.embeddings
        patches = emb.patch_embedding(pixels).flatten(2).transpose(1, 2)
        n_h, n_w = pixels.shape[2] // emb.patch_size, pixels.shape[3] // emb.patch_size
        side = emb.num_patches_per_side
        bounds = torch.arange(1 / side, 1.0, 1 / side, device=pixels.device)
        coords = [torch.arange(n, device=pixels.device, dtype=pixels.dtype) / n * (1 - 1e-6) for n in (n_h, n_w)]
        rows, cols = (torch.bucketize(c, bounds, right=True) for c in coords)
        positions = (rows[:, None] * side + cols).flatten()
        h = patches + emb.position_embedding(positions)[None]
        h = tower.encoder(inputs_embeds=h, attention_mask=None).last_hidden_state
        return tower.post_layernorm(h)

    # -- the prefix, once per frame: the frames admitted together in one forward -----------------------
    def _prefix_rows(self, images: list[list[torch.Tensor]], tokens: list[torch.Tensor],
                     states: torch.Tensor) -> list[torch.Tensor]:
        """Each frame's prefix embeddings [L_b, d]: its cameras' tokens, its prompt's, its state's."""
        vlm = self.vlm_with_expert.vlm.model
        flat = by_shape([img for frame in images for img in frame], lambda px: vlm.connector(self._vision(px)))
        state_tokens = self.state_proj(states)
        rows, at = [], 0
        for b, (frame, ids) in enumerate(zip(images, tokens)):
            cams = [h * torch.tensor(h.shape[-1] ** 0.5, dtype=h.dtype, device=h.device)
                    for h in flat[at:at + len(frame)]]
            lang = vlm.text_model.get_input_embeddings()(ids)
            rows.append(torch.cat([*cams, lang * math.sqrt(lang.shape[-1]), state_tokens[b][None]]))
            at += len(frame)
        return rows

    @torch.inference_mode()
    def encode_prefixes(self, images: list[list[torch.Tensor]], tokens: list[torch.Tensor],
                        states: torch.Tensor) -> list[Prefix]:
        """B frames' prefix caches from ONE pass: images[b] the frame's cameras [3, h, w] (resized, in
        [-1, 1]), tokens[b] its prompt [T_b], states [B, max_state_dim].

        Frame b's prefix is [cameras] ++ [prompt] ++ [state], L_b tokens; the rows are padded on the
        right to L_max. The mask is frame b's own (images and prompt see each other, the state sees
        them all, no real token sees a padded one) and positions run 0..L_b-1, so row b computes what
        frame b alone computes; its caches are cut back to L_b afterwards.
        """
        rows = self._prefix_rows(images, tokens, states)
        lengths = [r.shape[0] for r in rows]
        b, lmax, dev = len(rows), max(lengths), rows[0].device
        x = stack_right(rows, lmax)
        att = torch.zeros(b, lmax, dtype=torch.long, device=dev)
        att[torch.arange(b, device=dev), torch.tensor(lengths, device=dev) - 1] = 1  # each frame's state token
        mask = att_2d_masks(pad_mask(lengths, lmax, dev), att)
        pos = torch.arange(lmax, device=dev)[None].expand(b, lmax)
        vlm = self.vlm_with_expert.vlm.model
        keys, values, cross = [], [], {}
        for i, layer in enumerate(vlm.text_model.layers):
            h = layer.input_layernorm(x)
            shape = (b, lmax, -1, self.head_dim)
            q = float32_rope(layer.self_attn.q_proj(h).view(shape), pos)
            k = float32_rope(layer.self_attn.k_proj(h).view(shape), pos)
            v = layer.self_attn.v_proj(h).view(shape)
            keys.append(k)
            values.append(v)
            out = layer.self_attn.o_proj(attend(q, k, v, mask)) + x
            x = layer.mlp(layer.post_attention_layernorm(out)) + out
            expert = self.expert_at[i]
            if expert is not None and not self._is_self_attn(i):
                cross[i] = tuple(proj(t.reshape(b, lmax, -1)).view(shape)
                                 for proj, t in ((expert.self_attn.k_proj, k), (expert.self_attn.v_proj, v)))
        return [Prefix([k[r, :n].clone() for k in keys], [v[r, :n].clone() for v in values],
                       {i: (ck[r, :n].clone(), cv[r, :n].clone()) for i, (ck, cv) in cross.items()}, n)
                for r, n in enumerate(lengths)]

    # -- one expert step for a stack of frames --------------------------------------------------------
    def _embed_suffix(self, x: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        action = self.action_in_proj(x)
        temb = time_embedding(time, self.width, float(self.cfg.get("min_period", 4e-3)),
                              float(self.cfg.get("max_period", 4.0))).to(action.dtype)
        h = torch.cat([action, temb[:, None, :].expand_as(action)], dim=2)
        return self.action_time_mlp_out(nn.functional.silu(self.action_time_mlp_in(h)))

    @torch.inference_mode()
    def velocity(self, prefixes: SlotView, x: torch.Tensor, time: torch.Tensor,
                 states: torch.Tensor | None = None) -> torch.Tensor:
        """v for B frames at once: x [B, chunk, max_action_dim], time [B] float32, each frame its own prefix."""
        b, s = x.shape[:2]
        lengths, lmax = prefixes.lengths, prefixes.lmax
        dev = x.device
        prefix_pad = pad_mask(lengths, lmax, dev)[:, None, :].expand(b, s, lmax)
        causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()[None].expand(b, s, s)
        self_mask = torch.cat([prefix_pad, causal], dim=2)
        self_pos = torch.tensor(lengths, device=dev)[:, None] + torch.arange(s, device=dev)[None]
        cross_pos = torch.arange(s, device=dev)[None].expand(b, s)
        h = self._embed_suffix(x, time)
        for i in range(self.num_vlm_layers):
            layer = self.expert_at[i]
            if layer is None:
                continue
            n = layer.input_layernorm(h)
            shape = (b, s, -1, self.head_dim)
            if self._is_self_attn(i):
                q = float32_rope(layer.self_attn.q_proj(n).view(shape), self_pos)
                k = float32_rope(layer.self_attn.k_proj(n).view(shape), self_pos)
                v = layer.self_attn.v_proj(n).view(shape)
                k = torch.cat([prefixes.get("k", i), k], dim=1)
                v = torch.cat([prefixes.get("v", i), v], dim=1)
                att = attend(q, k, v, self_mask)
            else:
                q = float32_rope(layer.self_attn.q_proj(n).view(shape), cross_pos)
                k, v = prefixes.get("ck", i), prefixes.get("cv", i)
                att = attend(q, k, v, prefix_pad)
            out = layer.self_attn.o_proj(att) + h
            h = layer.mlp(layer.post_attention_layernorm(out)) + out
        h = self.vlm_with_expert.lm_expert.norm(h)
        return self.action_out_proj(h.to(torch.float32))
