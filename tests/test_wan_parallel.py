"""Wan transformer sequence parallel (Ulysses) and tensor parallel equal the one-rank forward.

Pure tests: token ranges, the Ulysses buffers under a simulated all-to-all, rotary slicing, the
processor against diffusers' own, the head-sharded RMSNorm, the TP shard plan against what
`shard_wan` keeps, and `validate_wan_parallel`. Ray tests: the tiny `wan_shard_test` plugin
(tests/plugins/wan_shard.py) as a CP 2, TP 2 and CP 2 x TP 2 replica on gloo, against the
unsharded transformer in this process (fp32, <= 1e-5 absolute).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/python -m pytest tests/test_wan_parallel.py -q -x
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("diffusers")

from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig  # noqa: E402
from phyai_ray.config.parallel import (AttentionParallelConfig as A, DenseParallelConfig as D,  # noqa: E402
                                       MoeParallelConfig as M, OuterParallelConfig as O, ParallelConfig)
from phyai_ray.errors import ParallelConfigError  # noqa: E402
from phyai_ray.models.diffusers_pipeline.wan_attention import ParallelSelfAttention  # noqa: E402
from phyai_ray.nn.norm import HeadShardedRMSNorm  # noqa: E402
from phyai_ray.nn.rotary import rotate_pairs  # noqa: E402
from phyai_ray.nn.sequence import (SequenceSplit, heads_received, heads_send_buffer, tokens_received,  # noqa: E402
                                   tokens_send_buffer, token_ranges)
from phyai_ray.models.diffusers_pipeline.wan_parallel import (shard_wan, tp_shard_dim,  # noqa: E402
                                                              validate_wan_parallel)
from tests.plugins.wan_shard import I2V, sample_inputs, tiny_wan, tiny_wan_config  # noqa: E402

TOLERANCE = 1e-5
CP2 = ParallelConfig(attention=A(cp_size=2))
TP2 = ParallelConfig(attention=A(tp_size=2), dense=D(tp_size=2))
CP2_TP2 = ParallelConfig(attention=A(tp_size=2, cp_size=2), dense=D(tp_size=2, dp_size=2))


# -- token ranges and the Ulysses exchange ---------------------------------------------------------

@pytest.mark.parametrize("tokens, parts, want", [
    (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
    (8, 2, [(0, 4), (4, 8)]),
    (27, 2, [(0, 14), (14, 27)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (5, 1, [(0, 5)]),
])
def test_token_ranges(tokens, parts, want):
    assert token_ranges(tokens, parts) == want


def test_token_ranges_refuse_fewer_tokens_than_ranks():
    with pytest.raises(ValueError, match="cannot split 2 latent tokens over 3 sequence-parallel ranks"):
        token_ranges(2, 3)


def simulated_all_to_all(buffers, in_sizes, out_sizes):
    """What all_to_all_single gives each rank: chunk j of every rank's buffer goes to rank j."""
    chunks = [b.split(sizes) for b, sizes in zip(buffers, in_sizes)]
    return [torch.cat([chunks[src][dst] for src in range(len(buffers))]) for dst in range(len(buffers))]


@pytest.mark.parametrize("tokens, cp, heads", [(8, 2, 4), (27, 2, 4), (10, 3, 6), (7, 4, 8)])
def test_ulysses_buffers_trade_tokens_for_heads_and_back(tokens, cp, heads):
    full = torch.randn(2, tokens, heads, 5, generator=torch.Generator().manual_seed(tokens))
    ranges = token_ranges(tokens, cp)
    sizes = [b - a for a, b in ranges]
    mine = [full[:, a:b] for a, b in ranges]
    sent = [heads_send_buffer(x, cp) for x in mine]
    got = [heads_received(r) for r in simulated_all_to_all(sent, [[s] * cp for s in sizes], [sizes] * cp)]
    group = heads // cp
    for j, g in enumerate(got):  # rank j: every token, head group j
        assert torch.equal(g, full[:, :, j * group:(j + 1) * group])
    back = simulated_all_to_all([tokens_send_buffer(g) for g in got], [sizes] * cp, [[s] * cp for s in sizes])
    for r, b in enumerate(back):
        assert torch.equal(tokens_received(b, cp), mine[r])


def test_rotary_of_a_token_range_is_the_range_of_the_rotary():
    model = tiny_wan(0)
    x = sample_inputs(frames=3, height=6, width=6)["hidden_states"]
    cos, sin = model.rope(x)  # [1, 27, 1, 12]
    q = torch.randn(2, cos.shape[1], 4, 12, generator=torch.Generator().manual_seed(3))
    whole = rotate_pairs(q, cos, sin)
    split = SequenceSplit("attention_cp", 1, 2)
    split.start(cos.shape[1])
    start, stop = split.ranges[1]
    assert (start, stop) == (14, 27)
    assert torch.equal(rotate_pairs(split.take(q, 1), split.take(cos, 1), split.take(sin, 1)), whole[:, start:stop])


@torch.no_grad()
def test_parallel_processor_on_one_rank_equals_diffusers():
    model, inputs = tiny_wan(0), sample_inputs()
    want = model(**inputs, return_dict=False)[0]
    for block in model.blocks:
        block.attn1.set_processor(ParallelSelfAttention(SequenceSplit("attention_cp", 0, 1), 12))
    got = model(**inputs, return_dict=False)[0]
    assert torch.equal(got, want)


def test_head_sharded_rms_norm_equals_rms_norm_over_all_heads():
    norm = torch.nn.RMSNorm(8, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 8)
    halves = [HeadShardedRMSNorm(norm, i, 2, "attention_tp") for i in range(2)]
    parts = x.chunk(2, -1)
    total = sum(h.squares(p) for h, p in zip(halves, parts))  # the all_reduce, by hand
    got = torch.cat([h.scale(p, total) for h, p in zip(halves, parts)], -1)
    assert (got - norm(x)).abs().max().item() <= 1e-6
    one = HeadShardedRMSNorm(norm, 0, 1, "attention_tp")
    assert (one(x) - norm(x)).abs().max().item() <= 1e-6  # a group of one: no collective


# -- the tensor-parallel shard plan ------------------------------------------------------------------

@pytest.mark.parametrize("name, dim", [
    ("blocks.0.attn1.to_q.weight", 0), ("blocks.3.attn2.to_v.bias", 0), ("blocks.1.attn1.norm_k.weight", 0),
    ("blocks.0.attn2.add_k_proj.weight", 0), ("blocks.0.attn2.norm_added_k.weight", 0),
    ("blocks.0.ffn.net.0.proj.weight", 0), ("blocks.0.ffn.net.0.proj.bias", 0),
    ("blocks.0.attn1.to_out.0.weight", 1), ("blocks.12.ffn.net.2.weight", 1),
    ("blocks.0.attn1.to_out.0.bias", None), ("blocks.0.ffn.net.2.bias", None), ("proj_out.weight", None),
    ("blocks.0.scale_shift_table", None), ("condition_embedder.text_embedder.linear_1.weight", None),
])
def test_tp_shard_dim(name, dim):
    assert tp_shard_dim(name) == dim


def fake_ctx(parallel: ParallelConfig, tp_rank: int) -> SimpleNamespace:
    """Group ranks of one rank of a TP group, enough to BUILD a shard (building needs no collective)."""
    sizes = {"attention_tp": parallel.attention.tp_size, "dense_tp": parallel.dense.tp_size,
             "attention_cp": parallel.attention.cp_size}
    return SimpleNamespace(rank=tp_rank, parallel=parallel, group_size=lambda g: sizes.get(g, 1),
                           group_rank=lambda g: tp_rank if g in ("attention_tp", "dense_tp") else 0)


@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_shard_wan_keeps_the_chunks_tp_shard_dim_names(tp_rank, variant):
    overrides = I2V if variant == "i2v" else {}
    full = tiny_wan(0, **overrides).state_dict()
    shard = shard_wan(tiny_wan(0, **overrides), fake_ctx(TP2, tp_rank)).state_dict()
    assert shard.keys() == full.keys()
    split = [name for name in full if tp_shard_dim(name) is not None]
    image = 5 if variant == "i2v" else 0  # add_k_proj, add_v_proj (weight, bias), norm_added_k
    assert len(split) == 2 * (2 * 9 + image + 3)  # per attention: q, k, v (weight, bias), 2 norms, out; FFN 3
    for name, tensor in full.items():
        dim = tp_shard_dim(name)
        want = tensor if dim is None else tensor.chunk(2, dim)[tp_rank]
        assert torch.equal(shard[name], want), name


def test_shard_wan_on_one_rank_changes_nothing_and_refuses_twice():
    model = tiny_wan(0)
    assert shard_wan(model, fake_ctx(ParallelConfig(), 0)) is model
    sharded = shard_wan(tiny_wan(0), fake_ctx(TP2, 0))
    with pytest.raises(ValueError, match="already applied"):
        shard_wan(sharded, fake_ctx(TP2, 0))


# -- validation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("parallel", [
    ParallelConfig(), CP2, TP2, CP2_TP2, ParallelConfig(outer=O(cfg_size=2), attention=A(cp_size=2)),
    ParallelConfig(attention=A(cp_size=4)),
])
def test_validate_accepts(parallel):
    validate_wan_parallel(tiny_wan_config(), parallel)


@pytest.mark.parametrize("parallel, config, why", [
    (ParallelConfig(attention=A(cp_size=3)), {}, "num_attention_heads=4 is not divisible by attention.tp_size "
                                                 "* attention.cp_size = 1 * 3"),
    (ParallelConfig(attention=A(tp_size=2, cp_size=4), dense=D(tp_size=2, dp_size=4)), {},
     "= 2 * 4 (Ulysses and tensor parallel split whole heads; ring attention is not implemented)"),
    (ParallelConfig(attention=A(dp_size=2)), {}, "attention.dp_size=2"),
    (ParallelConfig(outer=O(pp_size=2)), {}, "outer.pp_size=2"),
    (ParallelConfig(attention=A(tp_size=2)), {}, "dense.tp_size=1 != attention.tp_size=2"),
    (ParallelConfig(moe=M(ep_size=2)), {}, "Wan has no mixture-of-experts layers"),
    (TP2, {"ffn_dim": 33}, "ffn_dim=33 is not divisible by dense.tp_size=2"),
])
def test_validate_refuses_naming_the_rule(parallel, config, why):
    with pytest.raises(ParallelConfigError, match="the Wan transformer cannot run") as err:
        validate_wan_parallel(tiny_wan_config(**config), parallel)
    assert why in str(err.value)
    assert "Supported:" in str(err.value)


def test_validate_reads_a_transformer_config_object():
    with pytest.raises(ParallelConfigError, match="num_attention_heads=4"):
        validate_wan_parallel(tiny_wan(0).config, ParallelConfig(attention=A(cp_size=3)))


# -- real gloo groups on Ray ---------------------------------------------------------------------------

REQUESTS = [  # even split, uneven (27 tokens over 2), Wan 2.2 TI2V per-token timestep, batch of 1, I2V
    sample_inputs(seed=1),
    sample_inputs(seed=2, width=6),
    sample_inputs(seed=3, width=6, per_token_timestep=True),
    sample_inputs(seed=4, batch=1, frames=2, height=4, width=4),
    sample_inputs(seed=5, image_tokens=4),
]


@pytest.fixture(scope="module")
@torch.no_grad()
def expected() -> list[torch.Tensor]:
    t2v, i2v = tiny_wan(0), tiny_wan(0, **I2V)
    return [(i2v if "encoder_hidden_states_image" in r else t2v)(**r, return_dict=False)[0] for r in REQUESTS]


@pytest.mark.ray
@pytest.mark.parametrize("layout", ["cp2", "tp2", "cp2_tp2"])
def test_sharded_forward_on_ray_equals_one_rank(layout, expected, ray_session):
    parallel = {"cp2": CP2, "tp2": TP2, "cp2_tp2": CP2_TP2}[layout]
    args = EngineArgs(plugin="tests.plugins.wan_shard:WanShardEntry", plugin_args={"seed": 0},
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))
    with Engine(args, DeploymentConfig.local(cpus_per_rank=0.5)) as engine:
        got = [engine.submit(r).result(timeout=180) for r in REQUESTS]
    for i, (g, want) in enumerate(zip(got, expected)):
        assert g.shape == want.shape, (layout, i, g.shape)
        err = (g - want).abs().max().item()
        assert err <= TOLERANCE, f"{layout}: request {i} max abs error {err:.2e} > {TOLERANCE}"


def test_plugin_refuses_heads_that_do_not_divide():
    args = EngineArgs(plugin="tests.plugins.wan_shard:WanShardEntry",
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=ParallelConfig(
                          attention=A(cp_size=3))))
    with pytest.raises(ParallelConfigError, match="ring attention is not implemented"):
        Engine(args, DeploymentConfig.local(cpus_per_rank=0.5))
