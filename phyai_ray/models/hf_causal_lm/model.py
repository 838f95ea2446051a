"""One rank of `hf_causal_lm`: a Llama-family decoder in plain torch over a paged KV cache.

    x = embed(tokens)                                   vocabulary rows over dense_tp, summed over the group
    per layer:  x += o_proj(attention(rope(q), rope(k), v) over the cache)     heads over attention_tp
                x += down(silu(gate(rms(x))) * up(rms(x)))                      hidden units over dense_tp
    logits = gather(rms(x_last) @ lm_head_shard.T)      every rank samples the same token from the full row

RMSNorm, rotary embeddings (`nn.rotary.Rope`), grouped-query attention, SwiGLU; Qwen2's q/k/v
biases; Qwen3's per-head q/k RMSNorm; a tied or separate lm_head: each built from `phyai_ray.nn`
(norm, rotary, linear; the attention kernels through `llm.ragged`). Grouped-query attention reads the
cache once per key/value head: the G = heads / kv_heads queries that share it are stacked, so the
cache holds kv heads only. Every rank reads only its slices from the safetensors files (`shards`).
Every generation runs on the paged KV cache (`phyai_ray.llm.paged_decoder`: a block pool sized
at load, preemption, chunked prefill, prefix caching, ragged attention): the iteration protocol's
sequences and a whole request's (`step` / `stream`) alike, through one forward. Each iteration
reports the cache (`KVReport`) to the engine, whose admission (`KVBlocks`) admits only sequences
that start at once; the budget of new tokens per iteration is the engine's (the payloads carry it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from phyai_ray.collectives import P
from phyai_ray.models.hf_causal_lm.checkpoint import Checkpoint
from phyai_ray.models.hf_causal_lm.config import CudaMemory, HFCausalLMConfig
from phyai_ray.models.hf_causal_lm.request import Parsed, TextRequest
from phyai_ray.models.hf_causal_lm.shards import ShardPlan, check_topology
from phyai_ray.llm.tokenizer import TextCodec
from phyai_ray.llm.blocks import BlockPool, block_bytes, blocks_for
from phyai_ray.llm.paged import PagedSequences
from phyai_ray.llm.paged_decoder import PagedDecoder
from phyai_ray.llm.ragged import RaggedBatch
from phyai_ray.llm.staging import WeightStage
from phyai_ray.llm.stops import StopScan
from phyai_ray.nn.linear import gather_columns, row_parallel, vocab_embedding
from phyai_ray.nn.norm import rms_norm
from phyai_ray.nn.rotary import rope_cos_sin, rotate_half
from phyai_ray.rank.loading import dtype_name

logger = logging.getLogger(__name__)
FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})


class HFCausalLM(PagedDecoder):
    """`hf_causal_lm` on one rank: the iteration protocol, `step` / `stream`, and weight updates by name."""

    _weight_version: Any = None

    def __init__(self, cfg: HFCausalLMConfig, ctx: Any) -> None:
        ckpt = Checkpoint.open(cfg.model, cfg.max_model_len)
        self.cfg, self.ctx, self.arch = cfg, ctx, ckpt.arch
        check_topology(self.arch, ctx.parallel)
        self.max_len = cfg.resolved_max_len(self.arch)
        dtype = cfg.resolved_dtype(self.arch, getattr(ctx.device, "type", "cpu"))
        self.dtype = getattr(torch, dtype) if dtype else ctx.dtype
        self.plan = ShardPlan.for_rank(self.arch, ctx)
        self.shapes = self.plan.full_shapes()
        on_cuda = getattr(ctx.device, "type", "cpu") == "cuda"
        free_at_start = torch.cuda.mem_get_info(ctx.device)[0] if on_cuda else 0  # before the weights
        self.w = {name: self._read(ckpt, name, shape) for name, shape in self.shapes.items()}
        self._tie()
        self.inv_freq = self.arch.rope.inverse_frequencies(self.arch.head_dim).to(ctx.device)
        self.codec: TextCodec | None = None  # loaded when a whole request (step / stream) brings text
        self.stage = WeightStage()  # a fleet update's weights, received while these serve
        memory = self._profile(free_at_start) if on_cuda and cfg.kv_cache_bytes is None else None
        self.paged = PagedSequences(self._block_pool(memory), max_seq=self.max_len, vocab=self.arch.vocab,
                                    token_budget=cfg.token_budget(),
                                    stop_scan=lambda stops: StopScan(self._text_codec(), stops))
        logger.info("hf_causal_lm rank %d: %s, %d layers, heads %d/%d kv %d/%d on this rank, vocab rows %d, %s",
                    ctx.rank, self.arch.family, self.arch.layers, self.plan.local_heads, self.arch.heads,
                    self.plan.local_kv_heads, self.arch.kv_heads, self.plan.vocab_rows, self.dtype)

    def _pool(self, num_blocks: int) -> BlockPool:
        a, cfg = self.arch, self.cfg
        return BlockPool(num_blocks=num_blocks, block_size=cfg.block_size, layers=a.layers,
                         kv_heads=self.plan.local_kv_heads, head_dim=a.head_dim,
                         to={"device": self.ctx.device, "dtype": self.dtype}, prefix_caching=cfg.enable_prefix_caching)

    @torch.inference_mode()
    def _profile(self, free_at_start: int) -> CudaMemory:
        """On CUDA: one iteration of `token_budget()` prompt tokens over a pool of one sequence,
        its peak activations, and what this process has taken since `free_at_start` (vLLM's profile run)."""
        n = min(self.cfg.token_budget(), self.max_len - 1)
        seqs = PagedSequences(self._pool(blocks_for(self.max_len, self.cfg.block_size)), max_seq=self.max_len,
                              vocab=self.arch.vocab, token_budget=n)
        seqs.admit(-1, {"prompt": [0] * n, "max_tokens": 1, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0,
                        "stop_token_ids": []})
        device = self.ctx.device
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        self.run(seqs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del seqs
        torch.cuda.empty_cache()
        free_now, total = torch.cuda.mem_get_info(device)
        return CudaMemory(total=total, free_at_start=free_at_start, free_now=free_now, peak_activations=peak)

    def _block_pool(self, memory: CudaMemory | None = None) -> BlockPool:
        """The KV blocks of this rank's kv heads, as many as the budget holds (`HFCausalLMConfig.kv_cache_budget`)."""
        a, cfg = self.arch, self.cfg
        shape = dict(layers=a.layers, kv_heads=self.plan.local_kv_heads, head_dim=a.head_dim)
        per_block = block_bytes(**shape, block_size=cfg.block_size, dtype=self.dtype)
        budget = cfg.kv_cache_budget(device=self.ctx.device, per_token=-(-per_block // cfg.block_size),
                                     max_len=self.max_len, memory=memory)
        # every rank the same pool: the fewest blocks any rank of the replica holds (ranks that hold more
        # would schedule chunks the others cannot, and their collectives would mismatch)
        num_blocks = P.agreed(budget // per_block, "min", "world")
        if num_blocks < blocks_for(self.max_len, cfg.block_size):
            raise ValueError(f"hf_causal_lm: a KV cache of {budget} bytes holds {num_blocks} blocks of "
                             f"{cfg.block_size} tokens ({per_block} bytes each), fewer than one sequence of "
                             f"max_model_len={self.max_len} needs; raise kv_cache_bytes (or gpu_memory_utilization) "
                             "or lower max_model_len")
        logger.info("hf_causal_lm rank %d: KV cache of %d blocks x %d tokens (%.1f MiB), prefix caching %s, "
                    "%d tokens per iteration", self.ctx.rank, num_blocks, cfg.block_size,
                    num_blocks * per_block / 2 ** 20, "on" if cfg.enable_prefix_caching else "off",
                    cfg.token_budget())
        return self._pool(num_blocks)

    def _read(self, ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        ckpt.check({name: shape})  # the entry checked them all before any rank started; the folder may have changed
        cut = self.plan.cut(name)
        if cut.dim is None:
            part = ckpt.full(name)
        elif cut.dim == 0:
            part = cut.padded(ckpt.rows(name, cut.start, cut.stop))
        else:
            part = ckpt.columns(name, cut.start, cut.stop)
        # a copy of our own: a slice may view the file's mapping, which a trainer saving into the same
        # folder could change under a running model (and whose pages would count only once touched)
        owned = part.to(device=self.ctx.device, dtype=self.dtype)
        return owned.clone() if owned.data_ptr() == part.data_ptr() else owned.contiguous()

    # -- weight updates by the trainer's names (named_parameters() or state_dict()) ---------------------
    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """{name: (full shape, dtype)} of every tensor an update may carry (a tied head: the embedding only)."""
        return {name: (shape, dtype_name(self.dtype)) for name, shape in self.shapes.items()}

    def weight_note(self, name: str, shape: tuple[int, ...], dtype: str) -> str | None:
        """Why a tensor outside `weight_specs` is accepted (the update's report lists it), or None to refuse it.

        A trainer's `state_dict()` carries a tied model's `lm_head.weight` (the embedding itself) and
        persistent buffers such as an older transformers' `rotary_emb.inv_freq`: both skipped, as the
        model has them already. A floating tensor of a known name and shape in another dtype is cast.
        """
        if name.endswith("rotary_emb.inv_freq") and len(shape) == 1:
            return "skipped (a rotary buffer the model computes itself)"
        if name == "lm_head.weight" and self.arch.tied and shape == self.shapes["model.embed_tokens.weight"]:
            return "skipped (tied: model.embed_tokens.weight serves as the head)"
        if self.shapes.get(name) == shape and dtype in FLOATING and self.dtype.is_floating_point:
            return f"cast from {dtype} to {dtype_name(self.dtype)} on receive"
        return None

    @torch.inference_mode()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy this rank's slice of each FULL tensor into place, cast to the model's dtype (checked
        against `weight_specs` and `weight_note` before); what `weight_note` skipped is skipped.
        After sleep(level=2) each tensor is allocated again as its update arrives."""
        for name, full in weights:
            if name not in self.shapes:
                continue
            part = self.plan.cut(name).take(full.to(self.ctx.device))
            if self.w[name].numel() == 0 and part.numel():  # dropped by sleep(level=2)
                self.w[name] = part.to(self.dtype).clone(memory_format=torch.contiguous_format)
            else:
                self.w[name].copy_(part)
        self._tie()

    # -- a fleet's staged update (phyai_ray.rl.fleet): received while serving, switched with the version --
    @torch.inference_mode()
    def stage_weights(self, version: Any, buckets: list) -> dict[str, Any]:
        """Receive FULL tensors in the trainer's buckets, keep this rank's slices beside the live
        weights (nothing served changes) and report the digest of the bytes received. A name or
        shape the model does not take raises (the fleet update then rolls back everywhere)."""
        return self.stage.receive(version, buckets, self._staged_part, self.ctx.rank)

    def discard_staged(self) -> int:
        """Forget a staged update (a fleet update that failed anywhere)."""
        self.stage.discard()
        return self.ctx.rank

    @property
    def weight_version(self) -> Any:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: Any) -> None:
        """Set by the engine when an update finishes: weights staged for `version` go live now, at
        the iteration boundary where the engine publishes it."""
        staged = self.stage.take(version)
        if staged:
            self.w.update(staged)
            self._tie()
        self._weight_version = version

    def _staged_part(self, name: str, full: torch.Tensor) -> torch.Tensor | None:
        want = self.shapes.get(name)
        if want is None or tuple(full.shape) != want:
            if self.weight_note(name, tuple(full.shape), dtype_name(full.dtype)) is not None:
                return None
            raise ValueError(f"rank {self.ctx.rank}: staged tensor {name!r} {tuple(full.shape)} is not a weight of "
                             f"this model (expected {want}); nothing was staged")
        part = self.plan.cut(name).take(full.to(self.ctx.device))
        return part.to(self.dtype).clone(memory_format=torch.contiguous_format)

    # -- sleep / wake (phyai_ray.rank.control) -----------------------------------------------------
    @torch.inference_mode()
    def sleep(self, level: int) -> int:
        """Level 1: the weights to the host (where they are already on CPU) and the KV blocks freed;
        level 2: both dropped (the next weight update refills the weights). Running sequences wait
        again and recompute their history once awake. Returns the bytes freed on this rank: the KV
        pool's, plus the weights' when dropped (level 2) or moved off the device (level 1 on CUDA)."""
        freed = self.cache_bytes()
        self.release_cache()
        on_device = getattr(self.ctx.device, "type", "cpu") != "cpu"
        if level >= 2 or on_device:
            freed += _unique_bytes(self.w.values())
        if level >= 2:
            self.w = {name: t.new_empty(0) for name, t in self.w.items()}
        elif on_device:
            self.w = {name: t.to("cpu") for name, t in self.w.items()}
        self._tie()
        if getattr(self.ctx.device, "type", "cpu") == "cuda":
            torch.cuda.empty_cache()
        _return_freed_memory()
        return freed

    @torch.inference_mode()
    def wake_up(self, tags: list[str]) -> None:
        """"weights": back on the device after level 1 (after level 2 the update refilled them);
        "kv_cache": the KV blocks allocated again."""
        if "weights" in tags:
            self.w = {name: t.to(self.ctx.device) for name, t in self.w.items()}
            self._tie()
        if "kv_cache" in tags:
            self.restore_cache()

    def _tie(self) -> None:
        if self.arch.tied:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]

    # -- whole requests (PagedDecoder.step / stream) --------------------------------------------------
    def parse(self, request: Any) -> Parsed:
        if isinstance(request, Parsed):  # the entry's validator parsed it already
            return request
        wants_text = isinstance(request, dict) and (request.get("text") is not None or bool(request.get("stop")))
        if wants_text:
            self._text_codec()
        return TextRequest.parse(request, self.arch.vocab, self.max_len, self.arch.eos_ids, self.codec)

    def _text_codec(self) -> TextCodec:
        """The checkpoint's tokenizer, loaded on this rank at the first request that needs text."""
        if self.codec is None:
            self.codec = TextCodec.open(self.cfg.model)
        return self.codec

    def logits(self, batch: RaggedBatch, cache: BlockPool) -> torch.Tensor:
        """Logits [R, vocab] (float32) at `batch.last`: the last token of each chunk that samples."""
        a = self.arch
        x = self._embed(batch.tokens)
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, self.dtype)
        for i in range(a.layers):
            p = f"model.layers.{i}."
            x = x + self._attention(rms_norm(x, self.w[p + "input_layernorm.weight"], a.eps), p, cos, sin,
                                    cache.layer(i), batch)
            x = x + self._mlp(rms_norm(x, self.w[p + "post_attention_layernorm.weight"], a.eps), p)
        if batch.last.numel() == 0:  # only prompt chunks that sample nothing (every rank alike)
            return x.new_zeros(0, a.vocab, dtype=torch.float32)
        h = rms_norm(x[batch.last], self.w["model.norm.weight"], a.eps)
        local = (h @ self.w["lm_head.weight"].T).float()
        return gather_columns(local, "dense_tp", a.vocab)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.plan.dense_size == 1:
            return F.embedding(tokens, self.w["model.embed_tokens.weight"])
        return vocab_embedding(tokens, self.w["model.embed_tokens.weight"], self.plan.vocab_start, "dense_tp")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.w.get(name + ".bias")
        return F.linear(x, self.w[name + ".weight"], bias)

    def _attention(self, h: torch.Tensor, p: str, cos: torch.Tensor, sin: torch.Tensor,
                   cache: tuple[torch.Tensor, torch.Tensor], batch: RaggedBatch) -> torch.Tensor:
        a, heads, kv = self.arch, self.plan.local_heads, self.plan.local_kv_heads
        q = self._linear(h, p + "self_attn.q_proj").view(-1, heads, a.head_dim)
        k = self._linear(h, p + "self_attn.k_proj").view(-1, kv, a.head_dim)
        v = self._linear(h, p + "self_attn.v_proj").view(-1, kv, a.head_dim)
        if a.qk_norm:
            q = rms_norm(q, self.w[p + "self_attn.q_norm.weight"], a.eps)
            k = rms_norm(k, self.w[p + "self_attn.k_norm.weight"], a.eps)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        batch.write(*cache, k, v)
        attended = batch.attend(q, *cache, k, v).view(q.shape[0], -1)
        o_proj = p + "self_attn.o_proj"
        return row_parallel(attended, self.w[o_proj + ".weight"], self.w.get(o_proj + ".bias"), "attention_tp")

    def _mlp(self, h: torch.Tensor, p: str) -> torch.Tensor:
        hidden = F.silu(self._linear(h, p + "mlp.gate_proj")) * self._linear(h, p + "mlp.up_proj")
        down = p + "mlp.down_proj"
        return row_parallel(hidden, self.w[down + ".weight"], self.w.get(down + ".bias"), "dense_tp")


def _unique_bytes(tensors: Any) -> int:
    """Bytes of distinct storages among `tensors` (a tied head shares the embedding's)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(seen.values())


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc keeps freed mid-sized tensors in its heap,
    so a CPU sleep would free nothing measurable otherwise); nothing where glibc is absent."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return
