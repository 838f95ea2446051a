"""Rank -> named groups: worked tables, then hypothesis properties over bounded configs.

Run: .venv/bin/pytest tests/test_topology.py -q
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, MoeParallelConfig, OuterParallelConfig,
                       ParallelConfig)
from placement.topology import GROUP_NAMES, Topology


def topo(pp=1, cfg=1, **domains) -> Topology:
    return Topology.from_parallel(ParallelConfig(outer=OuterParallelConfig(pp_size=pp, cfg_size=cfg), **domains))


def test_vllm_table_tp2_pp4():
    t = topo(pp=4, dense=DenseParallelConfig(tp_size=2))
    assert t.world_size == 8
    assert t.groups("dense_tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert t.groups("pp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert t.groups("cfg") == [(r,) for r in range(8)]
    assert t.groups("world") == [tuple(range(8))]
    assert t.output_rank == 6


def test_pp2_cfg2_tp2_table():
    t = topo(pp=2, cfg=2, dense=DenseParallelConfig(tp_size=2))
    assert t.world_size == 8
    assert t.groups("dense_tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert t.groups("cfg") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert t.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert t.output_rank == 4
    c = t.coords(7)
    assert (c["pp"], c["cfg"], c["dense_tp"], c["attention_dp"], c["world"]) == (1, 1, 1, 1, 7)
    assert t.rank_groups(5)["pp"] == (1, 5) and t.rank_groups(5)["cfg"] == (5, 7)


def test_attention_dp2_moe_ep2():
    t = topo(attention=AttentionParallelConfig(dp_size=2), moe=MoeParallelConfig(ep_size=2))
    assert t.world_size == 2
    assert t.groups("attention_dp") == [(0, 1)]
    assert t.groups("moe_ep") == [(0, 1)]
    assert t.groups("dense_dp") == [(0, 1)]  # inferred
    for name in ("attention_tp", "attention_cp", "moe_tp", "moe_dp", "dense_tp", "pp", "cfg"):
        assert t.groups(name) == [(0,), (1,)], name


def test_attention_tp2_dp2_with_moe_ep2_tp2():
    t = topo(attention=AttentionParallelConfig(tp_size=2, dp_size=2), moe=MoeParallelConfig(tp_size=2, ep_size=2))
    assert t.groups("attention_tp") == [(0, 1), (2, 3)]
    assert t.groups("attention_dp") == [(0, 2), (1, 3)]
    assert t.groups("moe_tp") == [(0, 1), (2, 3)]
    assert t.groups("moe_ep") == [(0, 2), (1, 3)]
    assert t.groups("dense_dp") == [(0, 1, 2, 3)]
    assert t.coords(3)["moe_ep"] == 1 and t.coords(3)["attention_tp"] == 1


def test_attention_cp_sits_between_dp_and_tp():
    t = topo(attention=AttentionParallelConfig(tp_size=2, cp_size=2, dp_size=2))
    assert t.groups("attention_tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert t.groups("attention_cp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert t.groups("attention_dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_unknown_group_and_rank_are_clear_errors():
    t = topo(dense=DenseParallelConfig(tp_size=2))
    with pytest.raises(KeyError, match="unknown group 'tp'; known groups: world, pp"):
        t.groups("tp")
    with pytest.raises(ValueError, match="rank 2 is outside this replica's world of 2 ranks"):
        t.coords(2)


# -- properties ------------------------------------------------------------------------------------

def _factor(draw, n: int, parts: int) -> list[int]:
    """Split n into `parts` positive factors whose product is n."""
    sizes = []
    for _ in range(parts - 1):
        d = draw(st.sampled_from([k for k in range(1, n + 1) if n % k == 0]))
        sizes.append(d)
        n //= d
    return sizes + [n]


@st.composite
def parallel_configs(draw) -> ParallelConfig:
    pp, cfg = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    domain_ranks = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    domains = {}
    if draw(st.booleans()):
        tp, dp = _factor(draw, domain_ranks, 2)
        domains["dense"] = DenseParallelConfig(tp_size=tp, dp_size=dp)
    if draw(st.booleans()):
        tp, cp, dp = _factor(draw, domain_ranks, 3)
        domains["attention"] = AttentionParallelConfig(tp_size=tp, cp_size=cp, dp_size=dp)
    if draw(st.booleans()) or not domains:
        tp, ep, dp = _factor(draw, domain_ranks, 3)
        domains["moe"] = MoeParallelConfig(tp_size=tp, ep_size=ep, dp_size=dp)
    return ParallelConfig(outer=OuterParallelConfig(pp_size=pp, cfg_size=cfg), **domains)


def _axis_size(p: ParallelConfig, name: str) -> int:
    if name == "world":
        return p.infer_replica_world_size()
    if name in ("pp", "cfg"):
        return getattr(p.outer, f"{name}_size")
    domain, _, axis = name.partition("_")
    return getattr(getattr(p, domain), f"{axis}_size")


@settings(max_examples=150, deadline=None)
@given(parallel_configs())
def test_groups_partition_the_world_with_the_right_sizes(p):
    t = Topology.from_parallel(p)
    world = p.infer_replica_world_size()
    assert t.world_size == world
    for name in GROUP_NAMES:
        groups = t.groups(name)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), name
        assert all(len(g) == _axis_size(p, name) for g in groups), name
        assert len(groups) == world // _axis_size(p, name)


def _rank_from_coords(p: ParallelConfig, c: dict[str, int]) -> int:
    """The module docstring's formula, written out independently."""
    d_dense = c["dense_dp"] * p.dense.tp_size + c["dense_tp"]
    d_attn = (c["attention_dp"] * p.attention.cp_size + c["attention_cp"]) * p.attention.tp_size + c["attention_tp"]
    d_moe = (c["moe_dp"] * p.moe.ep_size + c["moe_ep"]) * p.moe.tp_size + c["moe_tp"]
    assert d_dense == d_attn == d_moe
    return (c["pp"] * p.outer.cfg_size + c["cfg"]) * p.domain_ranks + d_dense


@settings(max_examples=150, deadline=None)
@given(parallel_configs())
def test_coords_agree_with_groups_and_the_formula(p):
    t = Topology.from_parallel(p)
    for rank in range(t.world_size):
        coords, groups = t.coords(rank), t.rank_groups(rank)
        assert coords["world"] == rank
        for name in GROUP_NAMES:
            assert groups[name][coords[name]] == rank
            assert groups[name] in t.groups(name)
        assert _rank_from_coords(p, coords) == rank
        tp = groups["dense_tp"]
        assert list(tp) == list(range(tp[0], tp[0] + len(tp)))  # tp is contiguous


@settings(max_examples=150, deadline=None)
@given(parallel_configs())
def test_output_rank_is_first_of_last_stage(p):
    t = Topology.from_parallel(p)
    c = t.coords(t.output_rank)
    assert c["pp"] == p.outer.pp_size - 1
    assert c["cfg"] == 0
    assert all(v == 0 for k, v in c.items() if k not in ("pp", "world"))
    last_stage = [r for r in range(t.world_size) if t.coords(r)["pp"] == p.outer.pp_size - 1]
    assert t.output_rank == min(last_stage)
