"""Turns: the running sequences a per-step budget cannot hold together take turns, step by step.

Without one (`InOrder`) the waiting heads join while the policy admits them beside every running
sequence, head first, and its first refusal ends the round (nothing overtakes the head it refused).
With a `Turns` admission policy (phyai_ray.plugins.admission) the iteration loop keeps up to
`Turns.resident` sequences on the ranks. Before every iteration it walks them and the waiting heads
in priority order, asking the wrapped per-step policy from nothing (`begin([])`) which step:

    take_turns      who steps this iteration (the first in order always does); a refused resident
                    sits out, a refused waiting head ends admission (nothing overtakes it) but the
                    residents behind it may still fill the budget
    switches        the plan's `pause` (stepped last time, sits out now) and `resume` (the reverse)
    turn_iterations a waiting request's finish-by estimate: the iterations until it ends behind
                    the residents ahead of it (those that do not fit beside it delay it)

Priority (`priority`, lower first), the same rule as the waiting queue's order (iterations.py):

    own deadline    its deadline (earliest deadline first)
    none            arrival + default_deadline_s + its remaining steps x the recent iteration pace

So a request without a deadline never sorts ahead of one due before it could even end, however
long its job (EDF then meets every deadline that can be met beside it); among requests without a
deadline the least remaining work goes first, and age counts like work: a request that arrived 1 s
earlier is worth 1 s of work, so later short arrivals overtake a long job only until it is older
than their work, and it is never starved.

Worked example: budget of one request, a 40-step job running (step 200 ms, no deadlines), a
4-step preview arrives 0.5 s in: job 0 + 10 + 37.5 x 0.2 = 17.5 s, preview 0.5 + 10 + 4 x 0.2 =
11.3 s -> the preview steps the next 4 iterations while the job sits out, then the job resumes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from phyai_ray.executors.sequences import Candidates, LoopSequence
from phyai_ray.plugins.admission import Turns

Key = Callable[[LoopSequence], float]
Head = Callable[["Key | None"], "LoopSequence | None"]  # the loop's next waiting head (finish-by by key)
Join = Callable[[LoopSequence], None]  # the loop admits its waiting head


def admission_of(policy: Any, horizon_s: float) -> "InOrder | TurnTaker":
    """The planner of a loop whose Entry gave `policy`: turns for a `Turns`, else in order."""
    return TurnTaker(policy, horizon_s) if isinstance(policy, Turns) else InOrder(policy)


class InOrder:
    """Admission without turns: every running sequence steps; the waiting heads join head first while
    the policy admits them beside those; its first refusal ends the round."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def plan(self, running: Collection[LoopSequence], rebuild: list[LoopSequence], pace_s: float,
             head: Head | None, join: Join) -> tuple[list, tuple, tuple]:
        """(admitted, pause, resume) of the next plan; `head(None)`: the loop's next waiting head
        (`head` None: admission is closed)."""
        self.policy.begin(Candidates(list(running)))
        admitted: list[LoopSequence] = []
        while head is not None and (seq := head(None)) is not None and self.policy.admit(seq.candidate()):
            join(seq)
            admitted.append(seq)
        return admitted, (), ()

    def iterations(self, seq: LoopSequence, running: Collection[LoopSequence], key: Key | None) -> None:
        """Finish-by counts a waiting request's own steps: every running sequence steps beside it."""
        return None


class TurnTaker:
    """The turns of one iteration loop whose admission policy is a `Turns` (see the module docstring)."""

    def __init__(self, policy: Turns, horizon_s: float) -> None:
        self.policy, self.horizon_s = policy, horizon_s

    def plan(self, running: Collection[LoopSequence], rebuild: list[LoopSequence], pace_s: float,
             head: Head | None, join: Join) -> tuple[list, tuple, tuple]:
        """(admitted, pause, resume) of the next plan: who steps (`take_turns`), the switches, the books.
        `head(key)`: the loop's next waiting head (`head` None: admission is closed); a rebuilt
        sequence starts its steps again."""
        residents = list(running)
        for seq in rebuild:  # recompute starts it again, stepping (Running.admit)
            seq.taken, seq.paused = 0, False
        key = self.key(pace_s)
        stepping, admitted = take_turns(residents, self.policy, key, (lambda: head(key)) if head else lambda: None,
                                        join)
        return (admitted, *switches(residents, stepping))

    def key(self, pace_s: float) -> Key:
        return lambda seq: priority(seq, pace_s, self.horizon_s)

    def iterations(self, seq: LoopSequence, running: Collection[LoopSequence], key: Key | None) -> int | None:
        """The finish-by iterations of waiting `seq`'s request behind the residents ahead of it by `key`."""
        steps = seq.request.steps
        if steps is None or key is None:
            return None
        mine = key(seq)
        ahead = sorted((s for s in running if key(s) < mine and not finished(s)), key=key)
        return turn_iterations(seq.cost, steps, [(s.cost, remaining(s)) for s in ahead], self.policy.budget)


def remaining(seq: LoopSequence) -> int:
    """Steps it still takes (0 when its `SequenceSpec.steps` is unknown)."""
    return max(seq.steps - seq.taken, 0) if seq.steps is not None else 0


def finished(seq: LoopSequence) -> bool:
    """It took all its steps; it stays running until its result comes (a decode stage's video)."""
    return seq.steps is not None and seq.taken >= seq.steps


def priority(seq: LoopSequence, pace_s: float, horizon_s: float) -> float:
    """Its place in the turn order and in the waiting queue (see the module docstring); `horizon_s`
    is default_deadline_s (else execution_timeout_s), `pace_s` the recent iteration time."""
    req = seq.request
    if req.deadline is not None:
        return req.deadline
    return req.submitted + horizon_s + remaining(seq) * pace_s


def take_turns(residents: list[LoopSequence], policy: Any, key: Key, head: Callable[[], LoopSequence | None],
               join: Join) -> tuple[list[LoopSequence], list[LoopSequence]]:
    """(stepping, admitted) of this iteration: `residents` and the waiting heads (`head()`: the next
    one to consider, or None; `join(seq)` admits it) in `key` order, each stepping when `policy`
    holds it. A head joins only while fewer than `policy.resident` sequences are on the ranks. A
    resident past its last step (a video being decoded) takes no turn and no budget."""
    on_ranks = len(residents)
    residents = sorted((s for s in residents if not finished(s)), key=key)
    policy.begin(())
    stepping: list[LoopSequence] = []
    admitted: list[LoopSequence] = []
    waiting = head() if on_ranks < policy.resident else None
    i = 0
    while i < len(residents) or waiting is not None:
        if waiting is not None and (i == len(residents) or key(waiting) < key(residents[i])):
            if not policy.admit(waiting.candidate()):
                waiting = None  # nothing overtakes a refused head
                continue
            join(waiting)
            admitted.append(waiting)
            stepping.append(waiting)
            on_ranks += 1
            waiting = head() if on_ranks < policy.resident else None
            continue
        seq = residents[i]
        i += 1
        if policy.admit(seq.candidate()):
            stepping.append(seq)
    return stepping, admitted


def switches(residents: list[LoopSequence], stepping: list[LoopSequence]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(pause, resume) idents of the plan, and each sequence's books: `paused`, and `taken` + 1 for
    those stepping (counted when planned: a failed iteration fails every running request anyway)."""
    steps = {id(s) for s in stepping}
    residents = [s for s in residents if not finished(s)]
    pause = tuple(s.ident for s in residents if id(s) not in steps and not s.paused)
    resume = tuple(s.ident for s in residents if id(s) in steps and s.paused)
    for seq in residents:
        seq.paused = id(seq) not in steps
    for seq in stepping:
        seq.taken += 1
    return pause, resume


def turn_iterations(cost: int, steps: int, ahead: list[tuple[int, int]], budget: int | None) -> int:
    """Iterations until a sequence of `cost` taking `steps` ends, behind `ahead` [(cost, remaining
    steps)] in priority order, when each iteration steps whoever fits in `budget` in that order (the
    first always). Group limits are not counted (the estimate is the optimistic one). One pass per
    change of who steps: ahead [(100, 40)], me (100, 4), budget 100 -> 44; budget 200 -> 4."""
    if budget is None:
        return steps
    left = [[c, r] for c, r in ahead if r > 0]
    mine, total = steps, 0
    while True:
        room, stepping = budget, []
        for item in left:
            if item[0] <= room or not stepping:
                room -= item[0]
                stepping.append(item)
        me = cost <= room or not stepping
        span = min([item[1] for item in stepping] + ([mine] if me else []))
        total += span
        for item in stepping:
            item[1] -= span
        if me:
            mine -= span
            if mine <= 0:
                return total
        left = [item for item in left if item[1] > 0]
