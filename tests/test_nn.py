"""The layers room on its own: each backend of the attention entry against the softmax formula in float64,
the rotary variants against each other and a worked example, the norms, and the parallel linears' split math.

The families' parity tests (transformers, diffusers, LeRobot, the parallel layouts) check the same layers
inside real models; these pin what each one promises.

Run: .venv/bin/pytest tests/test_nn.py -q
"""

from __future__ import annotations

import pytest
import torch

from phyai_ray.nn.attention import attention, attention_lse, merge_lse, register_backend
from phyai_ray.nn.linear import Cut, column_linear, shard_rows
from phyai_ray.nn.norm import GemmaRMSNorm, layer_norm, rms_norm
from phyai_ray.nn.rotary import Rope, float32_rope, gemma_rope, rope_cos_sin, rope_from_config, rotate_half, \
    rotate_pairs
from tests.tolerances import reordered


def _reference(q, k, v, mask):
    """softmax(q k^T / sqrt(d)) v in float64 with key/value heads repeated for grouped queries."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_each_backend_is_attention_with_grouped_queries_and_a_mask(backend, kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 5, 16, generator=g)
    k, v = torch.randn(2, 2, kv_heads, 7, 16, generator=g).unbind(0)
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.4
    mask[..., 0] = True  # every query sees a key
    out = attention(q, k, v, mask, backend=backend)
    assert out.shape == (2, 8, 5, 16)
    want = _reference(q, k, v, mask)  # float64: fp32's own error over 16- and 7-term sums
    torch.testing.assert_close(out.double(), want, **reordered(torch.float32, terms=16, depth=2, like=want))


def test_the_entry_refuses_what_it_cannot_run():
    q, k = torch.zeros(1, 6, 2, 4), torch.zeros(1, 4, 2, 4)
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4"):
        attention(q, k, k)
    with pytest.raises(ValueError, match="backend 'flash9' is not known; known: .*'eager'.*'sdpa'"):
        attention(q[:, :4], k, k, backend="flash9")


def test_a_registered_backend_serves_every_caller():
    seen = []
    register_backend("probe", lambda q, k, v, mask, scale: seen.append(q.shape) or torch.zeros_like(q))
    attention(torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), backend="probe")
    assert seen == [torch.Size([1, 2, 3, 4])]


def test_cascade_parts_merge_to_the_whole():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 4, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    whole = _reference(q, k, v, None)
    (o1, l1), (o2, l2) = attention_lse(q, k[..., :4, :], v[..., :4, :], None), attention_lse(q, k[..., 4:, :],
                                                                                             v[..., 4:, :], None)
    torch.testing.assert_close(merge_lse(o1, l1, o2, l2), whole)
    visible = torch.ones(9, 9, dtype=torch.bool).tril()
    o, _ = attention_lse(q, k, v, visible)
    torch.testing.assert_close(o, _reference(q, k, v, visible))


def test_rotary_worked_example_and_the_variants_agree():
    rope = Rope(theta=10000.0)
    torch.testing.assert_close(rope.inverse_frequencies(4), torch.tensor([1.0, 0.01]))
    cos, sin = rope_cos_sin(torch.tensor([3]), rope.inverse_frequencies(4), torch.float32)
    torch.testing.assert_close(cos[0, 0], torch.tensor([3.0, 0.03, 3.0, 0.03]).cos())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 3, 8, generator=g)
    positions = torch.arange(5).repeat(2, 1)
    cos, sin = rope_cos_sin(positions.reshape(-1), Rope().inverse_frequencies(8), torch.float32)
    llama = rotate_half(x.reshape(10, 3, 8), cos, sin).view_as(x)
    torch.testing.assert_close(gemma_rope(x, positions), llama)
    torch.testing.assert_close(float32_rope(x, positions), llama, **reordered(torch.float32, terms=8, like=llama))
    torch.testing.assert_close(llama.norm(dim=-1), x.norm(dim=-1), **reordered(torch.float32, terms=8, like=x))  # a rotation keeps lengths


def test_rotate_pairs_turns_each_channel_pair():
    x = torch.tensor([[[[1.0, 0.0, 0.0, 2.0]]]])
    angle = torch.tensor([torch.pi / 2, torch.pi / 2, torch.pi, torch.pi])
    out = rotate_pairs(x, angle.cos(), angle.sin())
    torch.testing.assert_close(out, torch.tensor([[[[0.0, 1.0, 0.0, -2.0]]]]), **reordered(torch.float32, terms=2, scale=2.0))


def test_rope_config_kinds_and_a_clear_refusal():
    assert rope_from_config({"rope_theta": 5e5}).theta == 5e5
    llama3 = rope_from_config({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert llama3.kind == "llama3" and llama3.inverse_frequencies(64)[-1] < Rope().inverse_frequencies(64)[-1]
    with pytest.raises(ValueError, match="rope type 'yarn' .* supported: \\['default', 'linear', 'llama3'\\]"):
        rope_from_config({"rope_scaling": {"type": "yarn"}}, "m/config.json")


def test_norms():
    x = torch.randn(4, 6, dtype=torch.float64)
    w = torch.rand(6, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), w * x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt())
    torch.testing.assert_close(layer_norm(x), (x - x.mean(-1, keepdim=True)) / (x.var(-1, unbiased=False,
                                                                                        keepdim=True) + 1e-5).sqrt())
    gemma = GemmaRMSNorm(6)
    with torch.no_grad():
        gemma.weight.fill_(0.5)
    normed, gate = gemma(x.float())
    assert gate is None
    torch.testing.assert_close(normed, 1.5 * rms_norm(x.float(), None, 1e-6))


def test_split_math():
    t = torch.arange(12.0).view(4, 3)
    assert shard_rows(t, 0, 1, 2).tolist() == [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]
    with pytest.raises(ValueError, match=r"cannot split a tensor of shape \(4, 3\) into 2 equal parts along dim 1"):
        shard_rows(t, 1, 0, 2)
    assert Cut(0, 3, 4, pad_to=2).take(t).tolist() == [[9.0, 10.0, 11.0], [0.0, 0.0, 0.0]]
    linear = torch.nn.Linear(3, 4)
    half = column_linear(linear, 1, 2)
    x = torch.randn(5, 3)
    torch.testing.assert_close(half(x), linear(x)[:, 2:])
