"""Packing Cosmos3 requests into one transformer forward, and the static layout of each one.

`Cosmos3OmniPipeline.__call__` builds, once per prompt and branch (cond / uncond), the static part of
its joint sequence: the text segment (token ids, 3-D mRoPE positions), then the vision segment (its
patch grid, which latent frames are noisy, their positions), then sound and action. `static_row`
does exactly that with the pipeline's own helpers, for one request and one branch (a `Row`).

`packed_forward(transformer, attention, rows)` runs ONE forward over many rows (requests of any
mode, prompt length, frame count and step): the text of every row first, then the generation tokens
of every row (the layout `PackedAttention` reads, cosmos3_attention.py), each row's indexes shifted
to its place, the per-token timesteps at each row's own step; a row whose text is cached (`Row.text`,
a `TextCache`) sends no text tokens, only its generation tokens. The transformer's forward takes lists
of vision / sound / action items already; only the indexes and the attention learn the packing.
It returns each row's predictions (vision, sound or None, action or None) as the transformer does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from phyai_ray.models.diffusers_pipeline.cosmos3_attention import Layout, PackedAttention, TextCache


@dataclass
class Row:
    """One request's branch in a forward: its static layout, its current tokens and timestep."""

    static: dict[str, Any]
    vision: torch.Tensor  # [1, C, T, h, w] in the transformer's dtype
    timestep: float
    sound: torch.Tensor | None = None  # [sound_dim, T]
    action: torch.Tensor | None = None  # [chunk, action_dim]
    domain: torch.Tensor | None = None  # [1] long
    text: TextCache | None = None  # its text keys / values: computed in its first forward, then read

    @property
    def text_tokens(self) -> int:
        """Its text tokens in this forward: none once its text is cached."""
        return 0 if self.text is not None and self.text.ready else self.static["und_len"]


def static_row(pipe: Any, text_ids: list[int], latents: torch.Tensor, sound: torch.Tensor | None,
               action: torch.Tensor | None, fps: tuple[float, float | None], vision_cond: list[int],
               action_cond: list[int], device: Any) -> dict[str, Any]:
    """The pipeline's static pack of one branch (its steps 3 and 5): text, vision, sound, action segments."""
    text = pipe._prepare_text_segment(text_ids, device=device)
    offset, und = text["vision_start_temporal_offset"], text["und_len"]
    vision = pipe._prepare_vision_segment(input_vision_tokens=latents, has_image_condition=bool(vision_cond),
                                          mrope_offset=offset, vision_fps=fps[0], curr=und, device=device,
                                          condition_frame_indexes=vision_cond)
    curr = und + vision["num_vision_tokens"]
    sound_part: dict[str, Any] = {}
    if sound is not None:
        sound_part = pipe._prepare_sound_segment(input_sound_tokens=sound, mrope_offset=offset, sound_fps=fps[1],
                                                 curr=curr, device=device)
        curr += sound_part["sound_len"]
    action_part: dict[str, Any] = {}
    if action is not None:
        action_part = pipe._prepare_action_segment(input_action_tokens=action, condition_frame_indexes=action_cond,
                                                   mrope_offset=offset, action_fps=fps[0], curr=curr, device=device)
        curr += action_part["action_len"]
    positions = [text["text_mrope_ids"], vision["vision_mrope_ids"]]
    positions += [part[key] for part, key in ((sound_part, "sound_mrope_ids"), (action_part, "action_mrope_ids"))
                  if part]
    return {**text, **vision, **sound_part, **action_part, "position_ids": torch.cat(positions, dim=1),
            "sequence_length": curr}


class _Packer:
    """The transformer's keyword arguments for rows packed text-first (see the module docstring)."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows
        self.und = [row.text_tokens for row in rows]
        self.gen = [row.static["sequence_length"] - row.static["und_len"] for row in rows]
        self.args: dict[str, list] = {}

    def add(self, name: str, value: Any) -> None:
        self.args.setdefault(name, []).append(value)

    def kwargs(self) -> dict[str, Any]:
        u_total, u_at, g_at = sum(self.und), 0, sum(self.und)
        for row, n_u, n_g in zip(self.rows, self.und, self.gen):
            s, text = row.static, row.static["und_len"]
            shift = g_at - text  # a gen index i of the row -> g_at + (i - text)
            self.add("input_ids", s["input_ids"][:n_u])
            self.add("text_indexes", s["text_indexes"][:n_u] + u_at)
            self.add("positions_und", s["position_ids"][:, :n_u])
            self.add("positions_gen", s["position_ids"][:, text:])
            self._modality(row, "vision", shift, s["num_noisy_vision_tokens"])
            if row.sound is not None:
                self._modality(row, "sound", shift, s["sound_len"])
            if row.action is not None:
                self._modality(row, "action", shift, s["num_noisy_action_tokens"])
                self.add("action_domain_ids", row.domain)
            u_at, g_at = u_at + n_u, g_at + n_g
        a = self.args
        out = {"input_ids": torch.cat(a["input_ids"]), "text_indexes": torch.cat(a["text_indexes"]),
               "position_ids": torch.cat(a["positions_und"] + a["positions_gen"], dim=1), "und_len": u_total,
               "sequence_length": g_at, "return_dict": False}
        for kind in ("vision", "sound", "action"):
            if f"{kind}_tokens" in a:
                out.update({f"{kind}_tokens": a[f"{kind}_tokens"], f"{kind}_token_shapes": a[f"{kind}_token_shapes"],
                            f"{kind}_noisy_frame_indexes": a[f"{kind}_noisy_frame_indexes"]})
                for name in ("sequence_indexes", "mse_loss_indexes", "timesteps"):
                    out[f"{kind}_{name}"] = torch.cat(a[f"{kind}_{name}"])
        if "action_domain_ids" in a:
            out["action_domain_ids"] = a["action_domain_ids"]
        return out

    def _modality(self, row: Row, kind: str, shift: int, noisy: int) -> None:
        s = row.static
        self.add(f"{kind}_tokens", getattr(row, kind))
        self.args.setdefault(f"{kind}_token_shapes", []).extend(s[f"{kind}_token_shapes"])
        self.args.setdefault(f"{kind}_noisy_frame_indexes", []).extend(s[f"{kind}_noisy_frame_indexes"])
        self.add(f"{kind}_sequence_indexes", s[f"{kind}_sequence_indexes"] + shift)
        self.add(f"{kind}_mse_loss_indexes", s[f"{kind}_mse_loss_indexes"] + shift)
        device = s[f"{kind}_sequence_indexes"].device
        self.add(f"{kind}_timesteps", torch.full((noisy,), row.timestep, device=device))


@torch.no_grad()
def packed_forward(transformer: Any, attention: PackedAttention,
                   rows: list[Row]) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """ONE forward over `rows`; each row's (vision [1, C, T, h, w], sound [D, T] or None, action [T, D] or None)."""
    packer = _Packer(rows)
    kwargs = packer.kwargs()
    attention.layout = Layout.of(packer.und, packer.gen, [row.text for row in rows])
    try:
        vision, sound, action = transformer(**kwargs)
    finally:
        attention.layout = None
    for row in rows:
        if row.text is not None:
            row.text.ready = True
    sounds, actions = iter(sound or []), iter(action or [])
    return [(vision[k], next(sounds) if row.sound is not None else None,
             next(actions) if row.action is not None else None) for k, row in enumerate(rows)]
