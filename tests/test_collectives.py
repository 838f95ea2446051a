"""`P` collectives: size-1 identity inline, and every op on 2 gloo ranks under torchrun.

The torchrun run (tests/scripts/collectives_check.py) writes each rank's outputs; the expected
values are computed here in one process from the same per-rank inputs.

Run: flock /tmp/phyai-ray-test.lock .venv/bin/pytest tests/test_collectives.py -q
"""

from __future__ import annotations


import pytest
import torch

from phyai_ray import P
from phyai_ray.process_groups import GroupSet
from placement.topology import GROUP_NAMES
from tests.scripts.collectives_check import SPLITS_IN, rank_input, splits_out
from tests.scripts.launch import torchrun_json

# -- size 1: the identity, no torch.distributed -----------------------------------------------------


@pytest.mark.parametrize("group", GROUP_NAMES)
def test_size_one_groups_are_the_identity(group):
    import torch.distributed as dist

    x = torch.arange(6.0).reshape(2, 3)
    with GroupSet.single().activate():
        assert (P.rank(group), P.size(group)) == (0, 1)
        assert P.all_reduce(x, group) is x
        assert P.all_reduce(x, group, op="max") is x
        assert P.all_gather(x, group, dim=1) is x
        assert P.reduce_scatter(x, group) is x
        assert P.broadcast(x, group, src=0) is x
        assert P.all_to_all(x, group) is x
        P.barrier(group)
    assert torch.equal(x, torch.arange(6.0).reshape(2, 3))
    assert not dist.is_initialized()


def test_bad_op_and_group_fail_on_one_rank_too():
    x = torch.ones(2)
    with pytest.raises(ValueError, match="all_reduce op 'mean' is not one of sum, max, min, avg"):
        P.all_reduce(x, "dense_tp", op="mean")
    with pytest.raises(KeyError, match="unknown group 'tp'"):
        P.all_reduce(x, "tp")


# -- 2 ranks under torchrun -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    return torchrun_json("tests.scripts.collectives_check", out, "collectives_rank{rank}.json", timeout_s=90)


def t(value) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


@pytest.mark.torchrun
def test_rank_and_size(two_rank_outputs):
    assert [(o["rank"], o["tp_rank"], o["size"]) for o in two_rank_outputs] == [(0, 0, 2), (1, 1, 2)]


@pytest.mark.torchrun
def test_all_reduce(two_rank_outputs):
    xs = [rank_input(r) for r in range(2)]
    for o in two_rank_outputs:
        assert torch.equal(t(o["all_reduce_sum"]), xs[0] + xs[1])
        assert torch.equal(t(o["all_reduce_max"]), torch.maximum(xs[0], xs[1]))
        assert torch.allclose(t(o["all_reduce_avg"]), (xs[0] + xs[1]) / 2)


@pytest.mark.torchrun
def test_agreed_is_one_integer_on_every_rank(two_rank_outputs):
    """Rank r passes 10 + 5r: both ranks end with the min (10) over the world and the max (15) over dense_tp."""
    assert [o["agreed"] for o in two_rank_outputs] == [[10, 15], [10, 15]]


@pytest.mark.torchrun
def test_all_gather(two_rank_outputs):
    xs = [rank_input(r) for r in range(2)]
    for o in two_rank_outputs:
        assert torch.equal(t(o["all_gather_0"]), torch.cat(xs, 0))
        assert torch.equal(t(o["all_gather_1"]), torch.cat(xs, 1))


@pytest.mark.torchrun
def test_reduce_scatter(two_rank_outputs):
    total = rank_input(0) + rank_input(1)
    for r, o in enumerate(two_rank_outputs):
        assert torch.equal(t(o["reduce_scatter"]), total.chunk(2, 0)[r])


@pytest.mark.torchrun
def test_broadcast_from_group_rank_1(two_rank_outputs):
    for o in two_rank_outputs:
        assert torch.equal(t(o["broadcast"]), rank_input(1))


@pytest.mark.torchrun
def test_send_recv(two_rank_outputs):
    assert two_rank_outputs[0]["send_recv"] is None
    assert torch.equal(t(two_rank_outputs[1]["send_recv"]), rank_input(0))


@pytest.mark.torchrun
def test_all_to_all(two_rank_outputs):
    xs = [rank_input(r) for r in range(2)]
    for r, o in enumerate(two_rank_outputs):
        assert torch.equal(t(o["all_to_all"]), torch.cat([x.chunk(2, 0)[r] for x in xs]))
        pieces = [list(torch.split(x, list(SPLITS_IN[src]))) for src, x in enumerate(xs)]
        expected = torch.cat([pieces[src][r] for src in range(2)])
        assert expected.shape[0] == sum(splits_out(r))
        assert torch.equal(t(o["all_to_all_uneven"]), expected)


@pytest.mark.torchrun
def test_barrier_waits_for_the_late_rank(two_rank_outputs):
    late_enter = two_rank_outputs[1]["barrier"]["enter"]
    assert two_rank_outputs[0]["barrier"]["exit"] >= late_enter - 0.05
    assert late_enter - two_rank_outputs[0]["barrier"]["enter"] > 0.1  # rank 0 arrived first and waited
