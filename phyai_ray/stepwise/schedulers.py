"""Per-request scheduler state: each sequence its own scheduler copy, or a cohort sharing one.

    seq = ScheduledSequence(value=latents, **own_scheduler(template, 30, device))   # its own copy
    form_cohorts(joined)            # sequences that joined together with one schedule share one instance
    advance(seqs, noise)            # the scheduler step of each (noise[id(seq)]: its prediction)

A scheduler here is a diffusers scheduler, or anything with its calling convention:
`set_timesteps(n, device=...)`, `.timesteps`, and `step(prediction, t, sample, return_dict=False)[0]`.
Schedulers keep per-instance state (their step index, a multistep history), so a request needs its
own: `own_scheduler` deep-copies the template and sets its timesteps, as diffusers' pipeline does
for one call.

A `Cohort` is what diffusers' own N-prompt call does with its one scheduler: sequences that joined
together with the same timesteps and value shape share ONE scheduler over their stacked rows, so each
step is one `scheduler.step` for the cohort instead of one per sequence (8 UniPC steps cost 9 ms for
one row and 11.5 ms for 8 rows on a 2-core CPU). The schedulers' math is row-wise, so a row equals what
its own scheduler gives. A member that leaves early (dropped, restarted) takes its rows out of the
shared state (`Cohort.remove`); the others go on. One that sits out its cohort's steps (turns)
parts from it with its own copy of the shared scheduler (`part_cohort`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from phyai_ray.stepwise.sequence import Sequence


def own_scheduler(template: Any, steps: int, device: Any, begin_index: int | None = None) -> dict[str, Any]:
    """{"scheduler": a deep copy of `template` with `steps` timesteps set, "timesteps": them, "steps": how
    many}: the keyword arguments of a `ScheduledSequence` (`begin_index`: set_begin_index, as Wan's pipeline)."""
    scheduler = copy.deepcopy(template)
    scheduler.set_timesteps(steps, device=device)
    if begin_index is not None:
        scheduler.set_begin_index(begin_index)
    return {"scheduler": scheduler, "timesteps": scheduler.timesteps, "steps": len(scheduler.timesteps)}


@dataclass(eq=False, kw_only=True)
class ScheduledSequence(Sequence):
    """A sequence stepped by a scheduler: its own copy (or its cohort's) and its timesteps."""

    scheduler: Any
    timesteps: torch.Tensor
    cohort: "Cohort | None" = None  # the sequences it shares a scheduler with (None: its own)

    @property
    def timestep(self) -> torch.Tensor:
        """The timestep of its next step."""
        return self.timesteps[self.index]


class Cohort:
    """Sequences that share ONE scheduler over their stacked rows (see the module docstring)."""

    def __init__(self, seqs: list[ScheduledSequence]) -> None:
        self.jobs = list(seqs)
        self.scheduler = seqs[0].scheduler
        for seq in seqs:
            seq.cohort, seq.scheduler = self, self.scheduler

    def remove(self, seq: ScheduledSequence) -> None:
        """`seq` leaves before the others: its rows leave every per-row tensor of the shared state."""
        k = self.jobs.index(seq)
        keep = torch.tensor([j for j in range(len(self.jobs)) if j != k])
        rows, ndim = len(self.jobs), seq.value.ndim
        for name, value in list(vars(self.scheduler).items()):
            taken = _take_rows(value, keep, rows, ndim)
            if taken is not value:
                setattr(self.scheduler, name, taken)
        del self.jobs[k]
        seq.cohort = None

    def step(self, noise: dict[int, torch.Tensor]) -> None:
        """One scheduler step of every member (`noise[id(seq)]` its guided prediction, [1, ...])."""
        seqs = self.jobs
        values = torch.cat([seq.value for seq in seqs])
        out = self.scheduler.step(torch.cat([noise[id(seq)] for seq in seqs]), seqs[0].timestep, values,
                                  return_dict=False)[0]
        for k, seq in enumerate(seqs):
            seq.took(out[k:k + 1])


def _take_rows(value: Any, keep: torch.Tensor, rows: int, ndim: int) -> Any:
    """`value` with only the rows `keep` when it is per-row state (a value-shaped tensor of `rows` rows,
    or a list / tuple of such); anything else (the schedule's arrays, scalars) unchanged."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, keep.to(value.device)) if value.ndim == ndim and value.shape[0] == rows else value
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_take_rows(v, keep, rows, ndim) for v in value)
    return value


def part_cohort(seq: ScheduledSequence | None) -> None:
    """`seq` goes on alone (turns: it sits out while its cohort steps): out of its cohort, with its own
    copy of the shared scheduler holding only its rows, so its later steps equal its cohort's math."""
    if seq is None or seq.cohort is None:
        return
    cohort = seq.cohort
    own, keep = copy.deepcopy(cohort.scheduler), torch.tensor([cohort.jobs.index(seq)])
    for name, value in list(vars(own).items()):
        taken = _take_rows(value, keep, len(cohort.jobs), seq.value.ndim)
        if taken is not value:
            setattr(own, name, taken)
    cohort.remove(seq)
    seq.scheduler = own


def form_cohorts(seqs: list[ScheduledSequence]) -> None:
    """Sequences that joined together with one step count and value shape become one cohort each."""
    groups: dict[tuple, list[ScheduledSequence]] = {}
    for seq in seqs:
        groups.setdefault((seq.steps, tuple(seq.value.shape)), []).append(seq)
    for members in groups.values():
        if len(members) > 1:
            Cohort(members)


def leave_cohort(seq: ScheduledSequence | None) -> None:
    """`seq` stops before its last step: out of its cohort, if it has one."""
    if seq is not None and seq.cohort is not None:
        seq.cohort.remove(seq)


def advance(seqs: list[ScheduledSequence], noise: dict[int, torch.Tensor]) -> None:
    """The scheduler step of every sequence in `seqs` (`noise[id(seq)]`: its guided prediction): a
    cohort's members in one call, the others each on its own scheduler."""
    stepped: set[int] = set()
    for seq in seqs:
        if seq.cohort is None:
            seq.took(seq.scheduler.step(noise[id(seq)], seq.timestep, seq.value, return_dict=False)[0])
        elif id(seq.cohort) not in stepped:
            stepped.add(id(seq.cohort))
            seq.cohort.step(noise)
