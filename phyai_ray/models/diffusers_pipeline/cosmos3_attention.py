"""`PackedAttention`: Cosmos3's dual-pathway attention over several requests packed into one forward.

`Cosmos3OmniTransformer` runs ONE joint sequence: a causal text prefix (the "understanding" pathway,
und) and the generation tokens after it (gen: video latents, sound, action), whose queries see the
whole prefix and every gen token. Its forward already takes lists of vision / sound / action items;
what makes one sequence of it is the attention. Packed here, the und rows of every request come
first, then the gen rows of every request:

    und = [text_1 | text_2 | ... | text_R]       each request causal over its own text only
    gen = [gen_1  | gen_2  | ... | gen_R ]       gen_r over (text_r + gen_r), nothing of the others

`PackedAttention` is installed as every layer's attention processor (diffusers' `set_processor`) and
reads the layout, `Layout(und=[...], gen=[...])`, that the family sets before each forward. The math
is diffusers' `Cosmos3AttnProcessor`: the same projections, per-head norms and rotary tables, then
variable-length attention over the segments (`segment_attention`): each request's segment is one
call of the attention entry (phyai_ray/nn/attention.py), so no request is padded to the longest and
no score is spent between requests. With one request the segments are the whole sequence.

The text prefix's keys and values are computed ONCE per request and branch: the text pathway is
causal over the text alone, so nothing of a denoising step changes it. A request's `TextCache`
keeps, per layer, the keys and values its generation tokens read (after the rotary table); from its
second forward on, its row enters with no text tokens at all (`Layout.und` 0 for it) and its
generation tokens read the cached ones. The same values as recomputing them, without the text's
projections, attention and MLPs in every later step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from phyai_ray.nn.attention import attention
from phyai_ray.nn.rotary import rotate_half


class TextCache:
    """One request's (one branch's) text keys and values per attention module, from its first forward."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.ready = False  # filled by a finished forward: later forwards send no text tokens


@dataclass
class Layout:
    """Per packed request: `und` its text tokens in this forward (0: read from its cache), `gen` its
    generation tokens (video, sound, action), `caches` its TextCache (None: none kept)."""

    und: list[int] = field(default_factory=list)
    gen: list[int] = field(default_factory=list)
    caches: list[TextCache | None] = field(default_factory=list)

    @classmethod
    def of(cls, und: list[int], gen: list[int], caches: list[TextCache | None] | None = None) -> "Layout":
        caches = list(caches) if caches is not None else [None] * len(und)
        if not len(und) == len(gen) == len(caches):
            raise ValueError(f"a Cosmos3 layout needs one und and gen length and cache per request, got {und}, "
                             f"{gen} and {len(caches)} caches")
        return cls(list(und), list(gen), caches)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      backend: str = "sdpa") -> torch.Tensor:
    """One request's attention: q [S, H, D] over k / v [T, KV, D] (grouped queries) -> [S, H, D]; `causal`:
    query i sees keys 0 .. i (T == S)."""
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril() if causal else None
    out = attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, backend=backend)
    return out[0].transpose(0, 1)


def _cuts(lengths: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in lengths:
        out.append((start, start + n))
        start += n
    return out


class PackedAttention:
    """Cosmos3AttnProcessor's math over the packed requests of `self.layout` (see the module docstring)."""

    def __init__(self, backend: str = "sdpa") -> None:
        self.layout: Layout | None = None
        self.backend = backend

    def __call__(self, attn: Any, und_seq: torch.Tensor, gen_seq: torch.Tensor,
                 rotary_emb: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.layout or Layout([und_seq.shape[0]], [gen_seq.shape[0]])
        heads, kv, d = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        q_und = attn.norm_q(attn.to_q(und_seq).view(-1, heads, d))
        k_und = attn.norm_k(attn.to_k(und_seq).view(-1, kv, d))
        v_und = attn.to_v(und_seq).view(-1, kv, d)
        q_gen = attn.norm_added_q(attn.add_q_proj(gen_seq).view(-1, heads, d))
        k_gen = attn.norm_added_k(attn.add_k_proj(gen_seq).view(-1, kv, d))
        v_gen = attn.add_v_proj(gen_seq).view(-1, kv, d)
        k_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        cos_und, sin_und, cos_gen, sin_gen = (t.unsqueeze(1) for t in rotary_emb)
        q_und, k_und = rotate_half(q_und, cos_und, sin_und), rotate_half(k_und, cos_und, sin_und)
        k_for_gen = rotate_half(k_for_gen, cos_und, sin_und)
        q_gen, k_gen = rotate_half(q_gen, cos_gen, sin_gen), rotate_half(k_gen, cos_gen, sin_gen)
        und_out, gen_out = [q_und[:0]], []
        for (u0, u1), (g0, g1), cache in zip(_cuts(layout.und), _cuts(layout.gen), layout.caches):
            if u1 > u0:  # its text in this forward: attended, and kept when it has a cache
                und_out.append(segment_attention(q_und[u0:u1], k_und[u0:u1], v_und[u0:u1], True, self.backend))
                text = (k_for_gen[u0:u1], v_und[u0:u1])
                if cache is not None:
                    cache.layers[id(attn)] = (text[0].clone(), text[1].clone())
            else:
                text = cache.layers[id(attn)]
            keys, values = torch.cat([text[0], k_gen[g0:g1]]), torch.cat([text[1], v_gen[g0:g1]])
            gen_out.append(segment_attention(q_gen[g0:g1], keys, values, False, self.backend))
        und = torch.cat(und_out).flatten(-2, -1)
        gen = torch.cat(gen_out).flatten(-2, -1)
        return attn.to_out(und), attn.to_add_out(gen)


def install(transformer: Any, processor: PackedAttention) -> None:
    """`processor` becomes the attention of every decoder layer of `transformer`."""
    for layer in transformer.layers:
        layer.self_attn.set_processor(processor)
