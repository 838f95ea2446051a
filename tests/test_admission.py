"""Admission policies of the iteration loop, as tables: running sequences, the waiting line, who joins.

Run: .venv/bin/pytest tests/test_admission.py -q

Each row: the policy, the running candidates, the waiting line (head first), and how many of the
line join: a policy admits from the head until its first refusal (nothing overtakes).
"""

from __future__ import annotations

import pytest

from phyai_ray.plugins.admission import CostBudget, GroupLimit, TokenBudget
from phyai_ray.plugins.iteration import AdmissionPolicy, Candidate


def run(policy, running: list[Candidate], waiting: list[Candidate]) -> int:
    """How many of `waiting` join, as the loop asks: begin, then admit from the head until a refusal."""
    policy.begin(running)
    joined = 0
    for candidate in waiting:
        if not policy.admit(candidate):
            break
        joined += 1
    return joined


def c(cost: int = 1, group=None, generated: int = 0, rebuild: bool = False) -> Candidate:
    return Candidate(cost=cost, group=group, generated=generated, rebuild=rebuild)


TABLE = [
    # TokenBudget: running rows cost 1, rebuilds cost + generated; the head always joins when nothing runs
    ("tokens: the docstring's example", TokenBudget(4, 12), [c(), c()], [c(5), c(4), c(3)], 2),
    ("tokens: nothing runs, a prompt over the budget runs alone", TokenBudget(4, 12), [], [c(30), c(1)], 1),
    ("tokens: a big head blocks the small ones behind it", TokenBudget(8, 12), [c()], [c(20), c(1)], 0),
    ("tokens: max_seqs bounds the running count", TokenBudget(2, 100), [c()], [c(1), c(1)], 1),
    ("tokens: max_seqs reached, none joins", TokenBudget(1, 100), [c()], [c(1)], 0),
    ("tokens: a rebuild takes cost + generated", TokenBudget(8, 12), [c(3, generated=6, rebuild=True)],
     [c(3), c(1)], 1),
    ("tokens: exactly the budget fits", TokenBudget(8, 10), [c(), c()], [c(4), c(4)], 2),
    # CostBudget: every running sequence costs its cost in every iteration
    ("cost: the docstring's example", CostBudget(8, 100), [c(40)], [c(50), c(20)], 1),
    ("cost: nothing runs, one over the budget runs alone", CostBudget(8, 100), [], [c(300), c(1)], 1),
    ("cost: running costs are counted each iteration", CostBudget(8, 100), [c(60), c(30)], [c(20)], 0),
    ("cost: max_seqs", CostBudget(2, 1000), [], [c(1), c(1), c(1)], 2),
    # GroupLimit: at most max_groups distinct groups in the iteration, on top of its policy
    ("groups: the docstring's example", GroupLimit(CostBudget(8, 100), 2), [c(group="a")],
     [c(group="b"), c(group="c"), c(group="a")], 1),
    ("groups: one group per iteration", GroupLimit(CostBudget(8, 100), 1), [c(group=(16, 16))],
     [c(group=(16, 16)), c(group=(16, 16)), c(group=(32, 32)), c(group=(16, 16))], 2),
    ("groups: nothing runs, the head's group opens", GroupLimit(TokenBudget(8, 100), 1), [],
     [c(group="lora-1"), c(group="lora-1"), c(group="lora-2")], 2),
    ("groups: the inner policy still refuses", GroupLimit(CostBudget(8, 10), 2), [c(8, "a")], [c(5, "a")], 0),
    ("groups: None is a group like any other", GroupLimit(CostBudget(8, 100), 1), [c()], [c(group="a")], 0),
]


@pytest.mark.parametrize("policy, running, waiting, joined", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_the_policies_admit_from_the_head_until_the_first_refusal(policy, running, waiting, joined):
    assert isinstance(policy, AdmissionPolicy)
    assert run(policy, running, waiting) == joined


def test_a_policy_starts_afresh_at_every_plan():
    policy = GroupLimit(TokenBudget(2, 10), 1)
    assert run(policy, [], [c(3, "a"), c(3, "a"), c(3, "a")]) == 2
    assert run(policy, [], [c(3, "b"), c(3, "b")]) == 2  # a new plan: the last one's count and group are gone
    assert run(policy, [c(3, "b")], [c(3, "a")]) == 0


def test_the_default_policy_is_the_batching_configs_token_budget():
    from phyai_ray import BatchingConfig, Entry

    policy = Entry().admission(BatchingConfig(max_num_seqs=3, max_num_batched_tokens=7))
    assert isinstance(policy, TokenBudget) and (policy.max_seqs, policy.budget) == (3, 7)
    assert repr(policy) == "TokenBudget(max_seqs=3, budget=7)"


@pytest.mark.parametrize("build, message", [
    (lambda: TokenBudget(0, 10), "TokenBudget: max_seqs must be an int >= 1, got 0"),
    (lambda: CostBudget(4, -1), "CostBudget: budget must be an int >= 1, got -1"),
    (lambda: CostBudget(4, 2.5), "CostBudget: budget must be an int >= 1, got 2.5"),
    (lambda: GroupLimit(TokenBudget(4, 10), 0), "GroupLimit: max_groups must be an int >= 1, got 0"),
    (lambda: GroupLimit(object(), 2), "GroupLimit: policy must have begin"),
])
def test_bad_limits_are_refused_with_the_value(build, message):
    with pytest.raises((ValueError, TypeError)) as info:
        build()
    assert message in str(info.value)
