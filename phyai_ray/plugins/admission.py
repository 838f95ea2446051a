"""Admission policies of the iteration loop: which waiting sequences join the next iteration.

An `Entry` picks one by overriding `admission(batching)` (the protocol: `plugins.iteration.AdmissionPolicy`).
Each is asked once per plan, `begin(running)` then `admit(head)` until it says no:

    TokenBudget(max_seqs, budget)       the default (BatchingConfig max_num_seqs, max_num_batched_tokens):
        a waiting sequence's cost is its prefill; every running sequence costs 1 (one new token),
        a rebuilt one cost + generated. max_seqs=4, budget=12, 2 running, waiting costs [5, 4, 3]:
        12 - 2 = 10 left -> 5 joins (5 left) -> 4 joins (1 left, 4 running) -> 3 waits (no slot)
    CostBudget(max_seqs, budget)        every sequence costs its cost in EVERY iteration it runs (a
        denoising step re-costs each running request: latent tokens x CFG branches).
        budget=100, running costs [40], waiting [50, 20]: 60 left -> 50 joins (10 left) -> 20 waits
    GroupLimit(policy, max_groups)      at most `max_groups` distinct `SequenceSpec.group`s per
        iteration (LoRA adapters, latent shapes), on top of `policy`. max_groups=2, running groups
        {"a"}, waiting ["b", "c", "a"]: "b" joins -> "c" waits (and "a" behind it: no overtaking)

    KVBlocks(policy)                    `policy`, and the ranks' KV cache (their latest `KVReport`): the
        head joins only when its prompt's blocks fit the free blocks less those of the sequences
        admitted since the report, and its prompt fits the token budget beside the tokens the ranks'
        own sequences take next (or the ranks hold nothing), so a sequence admitted starts on the
        ranks at once. report(free_blocks=10, block_size=16, busy_tokens=4, token_budget=64), waiting
        prompts [40, 40, 8]: 40 joins (3 blocks, 7 left; 44 tokens) -> 40 waits (84 > 64 tokens)

    Turns(policy, resident)             what `policy` (an every-iteration one: CostBudget, GroupLimit)
        cannot hold takes turns: up to `resident` sequences stay on the ranks, and in each iteration
        those the policy holds, in priority order, step; the others sit out (executors/turns.py).
        CostBudget(8, 100) in Turns, resident costs [100 (a 40-step job), 100 (a 4-step preview)]:
        one steps per iteration, the preview first (least remaining work): it ends after 4, not 40

Every policy admits the head when nothing runs, so a sequence larger than the budget runs alone
instead of waiting forever.

The per-step budget comes from the model: `per_step(batching, default)` builds the policy of a
plugin whose sequences cost every iteration, its budget `BatchingConfig.step_budget` when the
deployment sets one, else the `default` the Entry states (diffusers_pipeline: two requests of the
folder's recommended shape), with turns unless `BatchingConfig.over_budget` is "wait":

    class WanEntry(Entry):
        def admission(self, batching):
            return per_step(batching, default=2 * self.recommended_cost, max_groups=None)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from phyai_ray.plugins.iteration import AdmissionPolicy, Candidate, KVReport


def _positive(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: {name} must be an int >= 1, got {value!r}; e.g. {owner}(max_seqs=64, ...)")


class _Budget:
    """Up to `max_seqs` running; the head joins while its cost fits what is left (always when nothing runs)."""

    def __init__(self, max_seqs: int, budget: int) -> None:
        _positive(type(self).__name__, max_seqs=max_seqs, budget=budget)
        self.max_seqs, self.budget = max_seqs, budget
        self._running = 0
        self._left = budget

    def begin(self, running: Sequence[Candidate]) -> None:
        self._running = len(running)
        if self._running < self.max_seqs:  # else nothing joins: the candidates need not be read
            self._left = self.budget - self.spent(running)

    def spent(self, running: Sequence[Candidate]) -> int:
        """What the running sequences take of this iteration's budget."""
        raise NotImplementedError

    def admit(self, candidate: Candidate) -> bool:
        if self._running >= self.max_seqs or (candidate.cost > self._left and self._running):
            return False
        self._left -= candidate.cost
        self._running += 1
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_seqs={self.max_seqs}, budget={self.budget})"


class TokenBudget(_Budget):
    """Up to `max_seqs` running; the waiting head joins while its cost (its prefill) fits the tokens
    left of `budget` after the running rows (1 each) and the rebuilds (cost + generated each), and
    always when nothing runs (see the module docstring)."""

    def spent(self, running: Sequence[Candidate]) -> int:
        return sum(c.cost + c.generated if c.rebuild else 1 for c in running)


class CostBudget(_Budget):
    """Up to `max_seqs` running, and the costs of every running and admitted sequence within
    `budget` in every iteration; the head always joins when nothing runs (see the module docstring)."""

    def spent(self, running: Sequence[Candidate]) -> int:
        return sum(c.cost for c in running)


class GroupLimit:
    """`policy`, and at most `max_groups` distinct groups (`Candidate.group`, None being one) among
    the sequences of an iteration: a head of a new group waits while `max_groups` run."""

    def __init__(self, policy: AdmissionPolicy, max_groups: int) -> None:
        _positive("GroupLimit", max_groups=max_groups)
        if not isinstance(policy, AdmissionPolicy):
            raise TypeError(f"GroupLimit: policy must have begin(running) and admit(candidate), got {policy!r}; "
                            "e.g. GroupLimit(CostBudget(64, 4096), max_groups=2)")
        self.policy, self.max_groups = policy, max_groups
        self._running: Sequence[Candidate] = ()
        self._groups: set[Hashable | None] | None = None

    def begin(self, running: Sequence[Candidate]) -> None:
        self._running, self._groups = running, None  # the groups are read at the first admit, if any
        self.policy.begin(running)

    def admit(self, candidate: Candidate) -> bool:
        if self._groups is None:
            self._groups = {c.group for c in self._running}
        fresh = candidate.group not in self._groups
        if fresh and len(self._groups) >= self.max_groups:
            return False
        if not self.policy.admit(candidate):
            return False
        self._groups.add(candidate.group)
        return True

    def __repr__(self) -> str:
        return f"GroupLimit({self.policy!r}, max_groups={self.max_groups})"


class KVBlocks:
    """`policy`, and the ranks' KV cache, as vLLM's scheduler admits: the waiting head joins only when
    the ranks can start it in the coming iteration, so no admitted sequence waits on a rank (and a
    request's deadline, queue time and start are measured in the loop's queue, where it waits).

    From the ranks' latest `KVReport` (`report`), the head needs blocks_for(cost) blocks (its prompt;
    a cached prefix would need fewer) of `free_blocks` less those admitted since the report, and its
    prompt must fit `token_budget` beside `busy_tokens` and the prompts admitted since, unless the ranks
    hold nothing (then it starts in chunks). While a running sequence is being rebuilt (`recompute`:
    it feeds its whole history) nothing new joins. Whenever nothing runs the head joins, alone when
    no report came yet (a pool holds at least one sequence of max_model_len). Sequences the ranks
    preempted wait there, to be rebuilt first: the report reserves their blocks and tokens. No
    watermark: like vLLM, a prompt's blocks are reserved, not its max_tokens, so decodes that
    outgrow the pool preempt the newest running sequence on the ranks."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        if not isinstance(policy, AdmissionPolicy):
            raise TypeError(f"KVBlocks: policy must have begin(running) and admit(candidate), got {policy!r}; "
                            "e.g. KVBlocks(TokenBudget(256, 4096))")
        self.policy = policy
        self.capacity: KVReport | None = None
        self._blocks = self._tokens = 0  # taken by the sequences admitted since the report
        self._running = 0
        self._rebuild = False

    def report(self, capacity: KVReport) -> None:
        """The ranks' KV cache after an iteration: what was admitted before it is in it now."""
        self.capacity, self._blocks, self._tokens = capacity, 0, 0

    def begin(self, running: Sequence[Candidate]) -> None:
        rebuilding = getattr(running, "rebuilding", None)  # the loop's Candidates answer without a Candidate each
        self._running = len(running)
        self._rebuild = rebuilding() if rebuilding is not None else any(c.rebuild for c in running)
        self.policy.begin(running)

    def admit(self, candidate: Candidate) -> bool:
        if not self._fits(candidate) or not self.policy.admit(candidate):
            return False
        size = self.capacity.block_size if self.capacity is not None else 1
        self._blocks += -(-candidate.cost // size)
        self._tokens += candidate.cost
        self._running += 1
        return True

    def _fits(self, candidate: Candidate) -> bool:
        cap = self.capacity
        if not self._running:  # the ranks hold nothing (what left is dropped first): it starts alone
            return True
        if cap is None or self._rebuild:
            return False
        blocks = -(-candidate.cost // cap.block_size)
        tokens = cap.busy_tokens + self._tokens
        fits_tokens = cap.token_budget is None or tokens + candidate.cost <= cap.token_budget or tokens == 0
        return self._blocks + blocks <= cap.free_blocks and fits_tokens

    def __repr__(self) -> str:
        return f"KVBlocks({self.policy!r})"


class Turns:
    """Turn-taking over `policy`: up to `resident` sequences stay on the ranks (their state kept), and
    before every iteration the loop asks `policy` which of them step, from nothing (`begin([])`), in
    priority order (earliest deadline, then least remaining work: executors/turns.py), skipping the
    ones it refuses: those sit out this iteration. A waiting sequence joins only when it gets a turn
    and a resident slot is free. `policy` must cost a sequence in every iteration it steps
    (CostBudget, a GroupLimit of one); the per-rank model needs pause_sequence / resume_sequence
    (delegated to its phyai_ray.stepwise.sequence.Running)."""

    def __init__(self, policy: AdmissionPolicy, resident: int) -> None:
        _positive("Turns", resident=resident)
        inner = policy
        while isinstance(inner, GroupLimit):
            inner = inner.policy
        if not isinstance(policy, AdmissionPolicy) or isinstance(inner, (TokenBudget, Turns)):
            raise TypeError(f"Turns: policy must cost every stepping sequence in every iteration (CostBudget, or "
                            f"GroupLimit of one), got {policy!r}; e.g. Turns(CostBudget(64, 131040), resident=64)")
        self.policy, self.resident = policy, resident
        self.budget: int | None = getattr(inner, "budget", None)  # what one iteration holds (finish-by reads it)

    def begin(self, running: Sequence[Candidate]) -> None:
        self.policy.begin(running)

    def admit(self, candidate: Candidate) -> bool:
        return self.policy.admit(candidate)

    def __repr__(self) -> str:
        return f"Turns({self.policy!r}, resident={self.resident})"


def per_step(batching: Any, default: int, *, given: int | None = None,
             max_groups: int | None = None) -> AdmissionPolicy:
    """The admission of a plugin whose running sequences cost every iteration, with the budget from
    the model: `given` (the plugin's own argument, e.g. diffusers' max_latent_tokens_per_step), else
    `batching.step_budget`, else `default` (what the Entry states: e.g. two requests of the model's
    recommended shape). CostBudget(batching.max_num_seqs, budget), in GroupLimit when `max_groups`,
    in Turns(resident=batching.max_num_seqs) unless `batching.over_budget` is "wait"."""
    budget = given or getattr(batching, "step_budget", None) or default
    policy: AdmissionPolicy = CostBudget(batching.max_num_seqs, int(budget))
    if max_groups is not None:
        policy = GroupLimit(policy, max_groups)
    return Turns(policy, batching.max_num_seqs) if getattr(batching, "over_budget", "turns") == "turns" else policy
