"""The one attention entry every model family calls, with its backends (vLLM's `Attention` layer):

    attention(q, k, v, mask, backend="sdpa")    q [B, H, S, D], k / v [B, KV, T, D], H a multiple of KV
                                                (grouped queries), mask broadcastable to [B, 1, S, T]
                                                (True: may attend) -> [B, H, S, D]
    backends:
        "sdpa"        torch's scaled_dot_product_attention (FlashAttention / memory-efficient / math,
                      as torch picks for the device); the default
        "eager"       scores in float32, masked with float32's min, softmax in float32, then cast to
                      v's dtype (LeRobot's and openpi's arithmetic: their parity tests need it)
        "diffusers"   diffusers' `dispatch_attention_fn`, which honours diffusers' own backend choice
                      (`attention_backend(...)`, e.g. flash or sage) for the pipelines it loads
    attention_lse(q, k, v, visible)             output AND each query's log-sum-exp, for merging partial
    merge_lse(o1, lse1, o2, lse2)               softmaxes over disjoint keys (cascade attention: a shared
                                                prefix read once, each row's own suffix apart)
    over a paged KV cache (keys gathered per row from its blocks by `phyai_ray.llm.ragged`):
    decode_attention(q, k, v, visible)          one new query per row over its own keys (padded)
    paged_decode_attention(q, keys, values, blocks, rows, valid)
                                                the same read from the pool's blocks, no padded copy
    chunk_attention(q, k, v, mask)              a prompt chunk's queries over its sequence's keys
    cascade_attention(q, k, v, visible, prefixes)   decode rows whose groups share a prefix, read once
    cascade_merge(q, out, lse, prefixes)        the same from rows' own (out, lse) (`paged_attention_lse`)

A new kernel is one `register_backend(name, fn)` call and reaches every model at once.

Grouped queries without copying keys: query head h reads key/value head h // G (G = H / KV, transformers'
`repeat_kv`), so the G query heads of a group are laid side by side as rows of ONE product against
their shared keys: q [B, H, S, D] -> [B, KV, G * S, D] (a view), the mask repeated G times along S.
pi0's PaliGemma has 8 query heads on 1 key/value head: repeating the keys 8 times is what this avoids.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F

Backend = Callable[..., torch.Tensor]
_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, fn: Backend) -> None:
    """Make `fn(q, k, v, mask, scale)` (the entry's layout, grouped queries its own job) a backend."""
    _BACKENDS[name] = fn


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
              backend: str = "sdpa", scale: float | None = None) -> torch.Tensor:
    """Attention of q [B, H, S, D] over k / v [B, KV, T, D] (see the module docstring) -> [B, H, S, D]."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads "
                         f"(q {tuple(q.shape)}, k {tuple(k.shape)})")
    fn = _BACKENDS.get(backend)
    if fn is None:
        raise ValueError(f"attention backend {backend!r} is not known; known: {sorted(_BACKENDS)}")
    return fn(q, k, v, mask, scale)


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, KV, G * S, D]: each key/value head's G query heads as rows (module docstring)."""
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * s, d)


def group_mask(mask: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """A mask [.., S, T] for grouped rows [.., G * S, T] (row g * S + i is query i of group member g);
    a mask of one row [.., 1, T] (the same for every query) broadcasts as it is."""
    if mask is None or groups == 1 or mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    return mask.repeat(*([1] * (mask.dim() - 2)), groups, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float | None) -> torch.Tensor:
    b, h, s, d = q.shape
    kv = k.shape[1]
    if kv == h:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask is not None and mask.dim() == 4 and mask.shape[1] not in (1, kv):
        raise ValueError(f"attention: a per-head mask {tuple(mask.shape)} with grouped queries needs one row per "
                         f"key/value head ({kv}) or one for all")
    out = F.scaled_dot_product_attention(group_queries(q, kv), k, v, attn_mask=group_mask(mask, h // kv), scale=scale)
    return out.view(b, h, s, d)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None) -> torch.Tensor:
    b, h, s, d = q.shape
    kv, t = k.shape[1], k.shape[2]
    scores = torch.matmul(group_queries(q.float(), kv), k.float().transpose(-1, -2)).view(b, h, s, t)
    scores = scores * (d ** -0.5 if scale is None else scale)
    if mask is not None:  # adding float32's min gives exactly float32's min (scores are far below its
        # spacing, 2e31); a where over the mask (one row for all heads) plus one add is ~2.5x faster on
        # CPU than a where broadcast over every head
        scores = scores + torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs.view(b, kv, (h // kv) * s, t), v).view(b, h, s, d)


def _diffusers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float | None) -> torch.Tensor:
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    if k.shape[1] != q.shape[1]:
        raise ValueError("attention backend 'diffusers' serves equal query and key/value heads")
    out = dispatch_attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                dropout_p=0.0, is_causal=False, scale=scale)
    return out.transpose(1, 2)


register_backend("sdpa", _sdpa)
register_backend("eager", _eager)
register_backend("diffusers", _diffusers)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  visible: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v over the visible columns, and each query's log-sum-exp [..., 1].

    q [.., S, D], k / v [.., T, D] with equal leading dims (group queries first). Scores, the
    log-sum-exp and the output are accumulated in float32 at least (`accumulation_dtype`) and returned
    so, for `merge_lse` to merge before one rounding: in bfloat16 at 2,048 keys the log-sum-exp and the
    merge in bfloat16 erred 6x as much as SDPA on the same inputs."""
    acc = accumulation_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * q.shape[-1] ** -0.5
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v.to(acc)), lse


def merge_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """The attention over the union of two disjoint key sets from each set's output and log-sum-exp
    (in their dtype: `attention_lse`'s float32, rounded once by the caller)."""
    total = torch.logaddexp(lse1, lse2)
    return o1 * torch.exp(lse1 - total) + o2 * torch.exp(lse2 - total)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, the dtype itself when wider (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


# -- over a paged KV cache: each row's keys gathered from its blocks (`phyai_ray.llm.ragged`) ----------

def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, *,
                     backend: str = "sdpa") -> torch.Tensor:
    """One new query per row over that row's own keys -> [R, H, D].

    q [R, H, D]; k / v [R, KV, T, D], every row's columns in order, padded to the longest row;
    visible [R, 1, 1, T] hides a row's columns past its own length. Memory R x T: no query axis."""
    return attention(q[:, :, None], k, v, visible, backend=backend).reshape(q.shape)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                    backend: str = "sdpa") -> torch.Tensor:
    """The n new queries of ONE sequence over its keys -> [n, H, D] (a prompt, part of one, a rebuild).

    q [n, H, D]; k / v [1, KV, T, D], its cached columns then its own; mask [n, T] (True: may attend),
    e.g. query i at position c + i sees columns 0 .. c + i."""
    rows = q.transpose(0, 1).contiguous()[None]  # [1, H, n, D]
    return attention(rows, k, v, mask, backend=backend)[0].transpose(0, 1)


def cascade_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                      prefixes: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """`decode_attention` where groups of rows share leading keys, each group's read ONCE -> [R, H, D].

    q, k, v, visible as in `decode_attention`, but k / v hold each row's OWN columns only (after its
    group's prefix). `prefixes` yields (rows [m], keys [1, KV, P, D], values): the prefix of rows `rows`.
    Every row attends to its own columns; a group's m rows attend to their prefix together (m * G
    queries per key/value head); the two partial softmaxes are merged by their log-sum-exp, in float32
    (`attention_lse`), and rounded to q's dtype once. With the n samples of one prompt, the prompt's
    keys are read once instead of n times."""
    r, h, d = q.shape
    out, lse = attention_lse(q.view(r, k.shape[1], h // k.shape[1], d), k, v, visible)
    return cascade_merge(q, out, lse, prefixes)


def cascade_merge(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  prefixes: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Each row's own attention (out [R, KV, G, D] and lse [R, KV, G, 1], float32) merged with its
    group's shared prefix (see `cascade_attention`) -> [R, H, D] in q's dtype."""
    r, h, d = q.shape
    kv = out.shape[1]
    groups = h // kv
    dq = q.view(r, kv, groups, d)
    for rows, keys, values in prefixes:
        m = rows.numel()
        gq = dq[rows].permute(1, 0, 2, 3).reshape(1, kv, m * groups, d)  # the group's queries, per kv head
        po, plse = attention_lse(gq, keys, values, None)
        po = po.view(kv, m, groups, d).transpose(0, 1)
        plse = plse.view(kv, m, groups, 1).transpose(0, 1)
        out[rows] = merge_lse(out[rows], lse[rows], po, plse)
    return out.view(r, h, d).to(q.dtype)


def paged_attention_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor,
                        rows: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over ITS blocks of a paged cache, reading only those blocks (no padding).

    q [R, H, D]; keys / values the pool [N, bs, KV, D]; blocks [B]: every block some row reads, rows
    [B]: the row it belongs to, valid [B, bs]: its columns within that row's length. Returns out
    [R, KV, G, D] and lse [R, KV, G, 1] (float32 at least). One key/value head at a time, per
    block: scores [G, bs] in float32 and their max; per row the max over its blocks
    (`scatter_reduce`), the exponentials' sums and the weighted values added up (`index_add_`): a
    segment softmax. Transient memory: one head's keys (in float32) and values of the blocks read,
    about 3 / (2 KV) of the KV read, never R x (longest row)."""
    r, h, d = q.shape
    kv = keys.shape[2]
    g = h // kv
    acc = accumulation_dtype(q.dtype)
    qb = q.view(r, kv, g, d)[rows].to(acc)  # [B, KV, G, D]
    hidden = ~valid[:, None, :]
    out = torch.empty(r, kv, g, d, dtype=acc, device=q.device)
    lse = torch.empty(r, kv, g, 1, dtype=acc, device=q.device)
    for head in range(kv):
        k = keys[blocks, :, head].to(acc)  # [B, bs, D]: this head's keys of the blocks read
        scores = torch.bmm(qb[:, head], k.transpose(1, 2)).mul_(d ** -0.5).masked_fill_(hidden, float("-inf"))
        del k
        block_max = scores.amax(-1)  # [B, G]
        row_max = block_max.new_full((r, g), float("-inf")).scatter_reduce(
            0, rows[:, None].expand_as(block_max), block_max, "amax")
        weights = torch.exp(scores.sub_(row_max[rows][..., None]))
        total = row_max.new_zeros(r, g).index_add_(0, rows, weights.sum(-1))
        part = torch.bmm(weights.to(values.dtype), values[blocks, :, head]).to(acc)  # [B, G, D]
        out[:, head] = part.new_zeros(r, g, d).index_add_(0, rows, part) / total[..., None]
        lse[:, head] = (row_max + total.log())[..., None]
    return out, lse


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor,
                           rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`paged_attention_lse`'s output as [R, H, D] in q's dtype (decode rows sharing no prefix)."""
    out, _ = paged_attention_lse(q, keys, values, blocks, rows, valid)
    return out.view(q.shape).to(q.dtype)
