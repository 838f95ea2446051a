"""The per-rank reference transformer: pipeline stages and classifier-free-guidance branches.

    x = tokens_emb[tokens] + positions[:S] + labels_emb[label]     (stage 0 only)
    for each block of this stage: x = attention(x); x = dense_or_moe_mlp(x)
    logits = head(norm(x))                                          (last stage only)

Pipeline: with layers=4, pp=2, stage 0 owns blocks 0-1 and stage 1 blocks 2-3. A stage receives
the [B, S, dim] stream from its peer in the `pp` group (group rank - 1) and sends it on to
group rank + 1; ranks of one pp group share every other coordinate (cfg branch, domain ranks).

Guidance: the conditional branch uses the request's labels, the unconditional one the null
label (`classes`). With cfg=1 one rank runs both branches one after the other; with cfg=2
cfg rank 0 runs the conditional and cfg rank 1 the unconditional branch, and the last stage
combines them once with an all_gather over `cfg`: `uncond + scale * (cond - uncond)`.
Without guidance only cfg rank 0 works; cfg rank 1 returns at once (no collectives).
Only the output rank (first rank of the last stage, cfg rank 0) returns logits; others None.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from phyai_ray.collectives import P
from phyai_ray.models.reference_dit.config import ReferenceDiTConfig, check_topology
from phyai_ray.models.reference_dit.request import ParsedRequest, batch_key, check_layout, parse_batch, parse_request
from phyai_ray.nn import weights as W
from phyai_ray.nn.layers import Attention, DenseMLP, MoeMLP, norm

logger = logging.getLogger(__name__)


class ReferenceDiT:
    """One rank's shard of the reference transformer; `step(request)` runs one forward pass."""

    def __init__(self, cfg: ReferenceDiTConfig, ctx: Any) -> None:
        check_topology(cfg, ctx.parallel)
        self.cfg, self.ctx = cfg, ctx
        self.to = {"device": ctx.device, "dtype": ctx.dtype}
        self.stage, self.stages = ctx.group_rank("pp"), ctx.group_size("pp")
        self.branch, self.branches = ctx.group_rank("cfg"), ctx.group_size("cfg")
        per_stage = cfg.layers // self.stages
        self.block_ids = list(range(self.stage * per_stage, (self.stage + 1) * per_stage))
        self.blocks = [self._block(i) for i in self.block_ids]
        self.embed = {k: v.to(**self.to) for k, v in W.embedding_weights(cfg).items()} if self.stage == 0 else None
        self.head = {k: v.to(**self.to) for k, v in W.head_weights(cfg).items()} if self.is_last else None
        logger.info("reference_dit rank %d: stage %d/%d blocks %s, cfg branch %d/%d", ctx.rank, self.stage,
                    self.stages, self.block_ids, self.branch, self.branches)

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def _block(self, index: int, w: W.Weights | None = None) -> list:
        w = w if w is not None else W.block_weights(self.cfg, index)
        mlp = MoeMLP if self.cfg.is_moe_block(index) else DenseMLP
        return [Attention(self.cfg, w, self.ctx, self.to), mlp(self.cfg, w, self.ctx, self.to)]

    @torch.inference_mode()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Replace this rank's parts from FULL tensors named as `weights.full_weights` names them.

        Each part (the embeddings, a block, the head) is replaced whole, so a part must come with
        all of its tensors; parts that live on other pipeline stages are skipped.
        """
        parts = W.split_names(dict(weights))
        new_blocks = dict(zip(self.block_ids, self.blocks))
        for part, w in parts.items():
            if part == "embed" and self.stage == 0:
                self.embed = {k: v.to(**self.to) for k, v in _complete(part, w, W.embedding_weights(self.cfg)).items()}
            elif part == "head" and self.is_last:
                self.head = {k: v.to(**self.to) for k, v in _complete(part, w, W.head_weights(self.cfg)).items()}
            elif part.startswith("blocks.") and int(part[7:]) in new_blocks:
                index = int(part[7:])
                new_blocks[index] = self._block(index, _complete(part, w, W.block_weights(self.cfg, index)))
        self.blocks = [new_blocks[i] for i in self.block_ids]

    def sleep(self, level: int) -> int:
        """Nothing is cached here. Level 1 moves the weights to the host (a CPU rank's stay: 0 bytes),
        level 2 drops them (the next weight update refills every part); the bytes freed on this rank."""
        freed = 0
        for holder, key, tensor in self._weights():
            if tensor.numel() and (level == 2 or tensor.device.type != "cpu"):
                freed += tensor.numel() * tensor.element_size()
                holder[key] = tensor.to("cpu") if level == 1 else torch.empty(0, dtype=tensor.dtype)
        return freed

    def wake_up(self, tags: list[str]) -> None:
        """"weights": back on this rank's device (after level 2 the update has refilled them there)."""
        if "weights" in tags:
            for holder, key, tensor in self._weights():
                holder[key] = tensor.to(self.ctx.device)

    def _weights(self) -> list[tuple[dict, str, torch.Tensor]]:
        """(holder, key, tensor) of every weight this rank holds: its layers' attributes, embeddings, head."""
        holders = [vars(layer) for block in self.blocks for layer in block] + [self.embed or {}, self.head or {}]
        return [(h, k, t) for h in holders for k, t in list(h.items()) if isinstance(t, torch.Tensor)]

    @torch.inference_mode()
    def step(self, request: Any) -> torch.Tensor | None:
        """Logits [B, S, vocab] float32 on the output rank, None elsewhere."""
        req = parse_request(request, self.cfg)
        check_layout(req, self.ctx.parallel)
        return self._run(req)

    @torch.inference_mode()
    def step_batch(self, requests: list[Any]) -> list[torch.Tensor] | None:
        """Several requests of one batch key (same sequence length and guidance scale) as ONE forward:
        their samples are concatenated along the batch and the logits split back, one tensor per request."""
        if len({batch_key(r) for r in requests}) != 1:
            raise ValueError("reference_dit can batch only requests of one sequence length and guidance scale; "
                             "its batch_key keeps them apart")
        joined, sizes = parse_batch(requests, self.cfg)
        check_layout(joined, self.ctx.parallel)
        out = self._run(joined)
        if out is None:
            return None
        return list(out.split(sizes))

    def _run(self, req: ParsedRequest) -> torch.Tensor | None:
        guided = req.guidance_scale is not None
        if self.branches == 1:
            branches = [True, False] if guided else [True]
        elif guided or self.branch == 0:
            branches = [self.branch == 0]
        else:
            return None  # no guidance: the unconditional cfg ranks have nothing to do
        outs = [self._forward(req, conditional) for conditional in branches]
        if not self.is_last:
            return None
        if guided:
            cond, uncond = outs if self.branches == 1 else P.all_gather(outs[0][None], "cfg").unbind(0)
            outs = [uncond + req.guidance_scale * (cond - uncond)]
        return outs[0].float() if self.ctx.is_output_rank else None

    def _forward(self, req: ParsedRequest, conditional: bool) -> torch.Tensor | None:
        """Run this stage on one guidance branch; the last stage returns logits, others None."""
        x = self._embed(req, conditional) if self.stage == 0 else self._receive(req)
        for block in self.blocks:
            for layer in block:
                x = layer(x)
        if not self.is_last:
            P.send(x, self.stage + 1, group="pp")
            return None
        return norm(x) @ self.head["w"].T + self.head["b"]

    def _embed(self, req: ParsedRequest, conditional: bool) -> torch.Tensor:
        tokens, labels = req.tokens.to(self.ctx.device), req.labels.to(self.ctx.device)
        if not conditional:
            labels = torch.full_like(labels, self.cfg.classes)  # the null label
        e = self.embed
        return e["tokens"][tokens] + e["positions"][: req.seq] + e["labels"][labels][:, None, :]

    def _receive(self, req: ParsedRequest) -> torch.Tensor:
        buf = torch.empty(req.batch, req.seq, self.cfg.dim, **self.to)
        return P.recv(buf, self.stage - 1, group="pp")


def _complete(part: str, given: W.Weights, reference: W.Weights) -> W.Weights:
    """`given` when it holds exactly the part's tensors with their shapes; a clear error otherwise."""
    missing, extra = sorted(set(reference) - set(given)), sorted(set(given) - set(reference))
    bad = [k for k in given if k in reference and tuple(given[k].shape) != tuple(reference[k].shape)]
    if missing or extra or bad:
        raise ValueError(f"reference_dit load_weights: part {part!r} needs exactly {sorted(reference)} with the "
                         f"model's shapes; missing {missing}, unknown {extra}, wrong shape {bad}")
    return {k: v.float() for k, v in given.items()}
