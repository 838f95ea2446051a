"""Cascade attention keeps float32 accumulation under bfloat16 weights.

The cascade path (decode rows that share a prompt's blocks: GRPO's n samples) computes scores, their
log-sum-exp and the merge of the two partial softmaxes in float32, and rounds once. In bfloat16 at
2,048 keys its output is within 1.5x SDPA's own error against float64 on the same inputs; eight
samples of one prompt, seven of them decoded by cascade, are within 1.5x the unshared path's own
bfloat16 error (each against float32 of the same model).

Each path is compared with the exact answer, never with the other: two bfloat16 computations that round
in different places differ by up to the sum of their errors, so "shared within the plain path's error of
the plain path" held on one CPU's kernels only (AVX-512: |shared - plain| 0.0166 under an own error of
0.0180; AVX2: 0.0317 under 0.0180). Against float32 the cascade rows' error is 0.0191 (AVX-512) and 0.0220
(AVX2) beside the plain rows' 0.0180 and 0.0180: 1.06x and 1.22x, so the cascade path is as accurate as the
plain one and the old bound was one machine's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phyai_ray.llm.ragged as ragged
from phyai_ray.nn.attention import cascade_attention, decode_attention, paged_decode_attention
from tests.test_hf_causal_lm import PROMPTS, assert_matches, reference
from tests.test_hf_paged import LONG, SHARED, TOKENS, engine, submit_all, write_checkpoint

pytest.importorskip("transformers")


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


def test_cascade_in_bfloat16_at_2048_keys_is_within_1_5x_sdpa_error() -> None:
    g = torch.Generator().manual_seed(0)
    rows, heads, kv, d, prefix, own = 8, 4, 2, 128, 2016, 32
    q = torch.randn(rows, heads, d, generator=g).bfloat16()
    pk, pv = (torch.randn(1, kv, prefix, d, generator=g).bfloat16() for _ in range(2))
    ok, ov = (torch.randn(rows, kv, own, d, generator=g).bfloat16() for _ in range(2))
    visible = torch.ones(rows, 1, 1, own, dtype=torch.bool)
    out = cascade_attention(q, ok, ov, visible, [(torch.arange(rows), pk, pv)])
    keys = torch.cat([pk.expand(rows, -1, -1, -1), ok], 2).repeat_interleave(heads // kv, 1)
    values = torch.cat([pv.expand(rows, -1, -1, -1), ov], 2).repeat_interleave(heads // kv, 1)

    def sdpa(dtype: torch.dtype) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.to(dtype)[:, :, None], keys.to(dtype), values.to(dtype))[:, :, 0]

    exact = sdpa(torch.float64)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, exact) <= 1.5 * relative_error(sdpa(torch.bfloat16), exact)


def run(folder, dtype: str, caching: bool) -> list[list[float]]:
    """Greedy log-probs of eight copies of SHARED; with caching, seven of them decode by cascade."""
    with engine(folder, dtype=dtype, enable_prefix_caching=caching) as eng:
        submit_all(eng, [SHARED])  # its blocks cached: the eight below share them
        outs = submit_all(eng, [SHARED] * 8)
    return [o.log_probs for o in outs]


def test_eight_samples_sharing_a_prompt_in_bfloat16_are_as_accurate_as_unshared(tmp_path, monkeypatch) -> None:
    folder = write_checkpoint(tmp_path / "llama", "llama")
    calls = []
    for name in ("cascade_merge", "cascade_attention"):  # over blocks, or over a padded copy
        kernel = getattr(ragged, name)
        monkeypatch.setattr(ragged, name, lambda *a, kernel=kernel: calls.append(1) or kernel(*a))
    shared = torch.tensor(run(folder, "bfloat16", True))
    assert calls  # the cascade path served the shared rows
    plain = torch.tensor(run(folder, "bfloat16", False))
    exact = torch.tensor(run(folder, "float32", False))
    own = (plain - exact).abs().max()
    assert own > 0 and (shared - exact).abs().max() <= 1.5 * own


def test_decode_over_blocks_equals_attention_over_a_padded_copy() -> None:
    g = torch.Generator().manual_seed(2)
    bs, kv, d = 4, 2, 8
    lengths = [1, 5, 17, 9, 4, 30]
    tables, start = [], 1
    for n in lengths:
        tables.append(list(range(start, start + -(-n // bs))))
        start += len(tables[-1])
    keys, values = (torch.randn(start, bs, kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    q = torch.randn(len(lengths), 6, d, generator=g, dtype=torch.float64)
    blocks = torch.tensor([b for t in tables for b in t])
    rows = torch.tensor([i for i, t in enumerate(tables) for _ in t])
    valid = torch.arange(bs)[None, :] < torch.tensor([n - j * bs for n, t in zip(lengths, tables)
                                                       for j in range(len(t))])[:, None]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    visible = (torch.arange(width * bs)[None, :] < torch.tensor(lengths)[:, None]).view(len(lengths), 1, 1, -1)
    k, v = (c[table].view(len(lengths), width * bs, kv, d).transpose(1, 2) for c in (keys, values))
    torch.testing.assert_close(paged_decode_attention(q, keys, values, blocks, rows, valid),
                               decode_attention(q, k, v, visible))


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_generation_over_blocks_equals_transformers(tmp_path, monkeypatch, caching) -> None:
    from tests.hf_checkpoints import load_reference

    folder = write_checkpoint(tmp_path / "llama", "llama")
    model = load_reference(folder)
    monkeypatch.setattr(ragged, "PADDED_WASTE", 0.0)  # every decode iteration reads over blocks
    prompts = [LONG, *PROMPTS, SHARED, SHARED]
    with engine(folder, enable_prefix_caching=caching) as eng:
        outs = submit_all(eng, prompts)
    for out, prompt in zip(outs, prompts):
        assert_matches(out, reference(model, prompt, TOKENS))
