"""Joins do not stall the fleet: joining frames' prefix passes within a work budget per iteration.

Run: `.venv/bin/python -m pytest tests/test_lerobot_policy_joins.py -q` (inline, no Ray).

With plugin_args["prefix_budget"], the joining frames are grouped into passes whose one layer fits
the budget, and an iteration runs layers of those passes (SigLIP's, then the VLM's) until the budget
is spent, at least one: a running robot takes its
expert step in every iteration while others join, each iteration's prefix work is bounded, and
every chunk still equals LeRobot's. The gap ratio this buys is a timing, measured by
benchmarks/bench_policy.py (--joins), not asserted here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry
from tests.test_lerobot_policy import Cases, args_of
from tests.tolerances import against


@pytest.mark.parametrize("policy", ["pi0", "smolvla"])
def test_a_running_robot_steps_every_iteration_while_others_join_within_the_budget(policy):
    entry = LeRobotPolicyEntry({**args_of(policy), "prefix_budget": 1})
    rank = entry.create({}, SimpleNamespace(device="cpu"))
    cases = Cases(policy)
    frames = [entry.validate_request(cases.frame(i)) for i in range(cases.n)]
    rank.admit(0, frames[0])
    out = {}
    while rank.running[0].prefix is None:  # the first robot's own prefix, a layer per iteration
        out.update(rank.iterate())
    assert rank.running[0].index == 1  # its first step in the iteration its prefix completed
    for i in range(1, cases.n):
        rank.admit(i, frames[i])
    layers_seen = len(rank.joins.work)
    while 0 in rank.running:
        before = rank.running[0].index
        out.update(rank.iterate())
        assert 0 in out or rank.running[0].index == before + 1  # the running robot never waits for a join
    while len(rank.running):
        out.update(rank.iterate())
    work = rank.joins.work
    if policy == "pi0":  # a layer per iteration: the joiners' pass spread over iterations, each one layer's work
        assert layers_seen > 2 and len(work) > layers_seen + 2
        assert max(work[layers_seen:]) <= max(work[:layers_seen])  # one layer of one frame's rows at most
    else:  # SmolVLA's network runs its pass whole: one step of the phase each, one frame's per iteration
        assert len(work) == cases.n
    for i in range(cases.n):
        torch.testing.assert_close(out[i].value["actions"], cases.t["alone"][i], **against("lerobot", "chunks"))
    assert rank.prefix_stats() == {1: cases.n}  # a budget below one frame's layer: a pass per frame


def test_prefix_budget_is_checked():
    with pytest.raises(ValueError, match="prefix_budget"):
        LeRobotPolicyEntry({**args_of("pi0"), "prefix_budget": 0})
