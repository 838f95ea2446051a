"""Value sequences on one rank: a request that takes `steps` denoising steps, and the set of them
running, batched per step.

    running = Running()
    running.admit(7, Sequence(value=noise, steps=10))     # joins at the next step
    deltas = running.iterate(advance, result)             # advance(batch): ONE step of every sequence
                                                          # (each calls seq.took(new_value)); the ones
                                                          # whose last step this was leave with result(seq)
    running.pause(7); running.resume(7)                   # turns: 7 sits out the steps in between

A sequence is what a value plugin's rank keeps per request between iterations of the iteration
protocol (`phyai_ray/plugins/iteration.py`): its value tensor (a noisy action chunk, video latents),
how many of its steps it has taken, and for streams its progress {"step": i, "of": n}. A plugin
subclasses `Sequence` for what its math adds (a prefix cache, a scheduler, RTC guidance); the
running set, the step counting and the deltas are written once, here.

Turns (`IterationPlan.pause` / `resume`): a paused sequence stays in the set with its value, but
`batch()` leaves it out, so `iterate` neither steps it nor reports it; `admit` (a start, or a start
again) makes it step, and one paused before its first step joins (`joined()`) when it steps. A
per-rank model gets turns by delegating its `pause_sequence(seq_id)` and `resume_sequence(seq_id)`
to its `Running` (`pause` / `resume` without a sequence are the engine's hooks for the whole model).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

import torch

from phyai_ray.plugins.iteration import Delta, Deltas


@dataclass(eq=False, kw_only=True)  # a sequence is itself: found in lists by identity, never by its tensors
class Sequence:
    """One request on its way: its value after `index` of its `steps` steps."""

    value: torch.Tensor
    steps: int
    index: int = 0  # steps taken: the index of its next step

    @property
    def done(self) -> bool:
        return self.index >= self.steps

    @property
    def fraction(self) -> float:
        """How far it is: 0.0 before its first step, 1.0 after its last."""
        return self.index / self.steps if self.steps else 1.0

    @property
    def progress(self) -> dict[str, int]:
        """What its stream reports after a step: {"step": steps taken, "of": steps}."""
        return {"step": self.index, "of": self.steps}

    def took(self, value: torch.Tensor) -> None:
        """Its step `index` ended with `value`."""
        self.value = value
        self.index += 1


S = TypeVar("S", bound=Sequence)


class Running(Generic[S]):
    """The sequences running on a rank by their ident, in admission order; the ones admitted (or started
    again) since the last step are `joined()`, so a plugin can prepare them together."""

    def __init__(self) -> None:
        self._by_ident: dict[int, S] = {}
        self._joining: list[int] = []
        self._paused: set[int] = set()

    def admit(self, ident: int, seq: S) -> None:
        """`seq` runs from the next step on; an ident already running starts again as `seq` in its place
        (stepping: a paused one is resumed)."""
        self._by_ident[ident] = seq
        self._paused.discard(ident)
        if ident not in self._joining:
            self._joining.append(ident)

    def drop(self, ident: int) -> S | None:
        """Forget `ident` (before its last step); the sequence it was, or None."""
        if ident in self._joining:
            self._joining.remove(ident)
        self._paused.discard(ident)
        return self._by_ident.pop(ident, None)

    def pause(self, ident: int) -> None:
        """`ident` sits out the next steps, keeping its state, until `resume(ident)`; an ident not
        running (a sequence this rank already freed, e.g. after its own error) changes nothing."""
        if ident in self._by_ident:
            self._paused.add(ident)

    def resume(self, ident: int) -> None:
        """`ident` steps again from the next step on (a sequence not paused: nothing changes)."""
        self._paused.discard(ident)

    def paused(self) -> list[int]:
        """The idents sitting out, in admission order."""
        return [i for i in self._by_ident if i in self._paused]

    def joined(self) -> list[S]:
        """The stepping sequences admitted since the last call, in order (each is returned once; a
        paused one stays joining until it steps)."""
        joined = [self._by_ident[i] for i in self._joining if i in self._by_ident and i not in self._paused]
        self._joining = [i for i in self._joining if i in self._paused]
        return joined

    def batch(self) -> list[S]:
        """Every running sequence that steps (not paused), in admission order."""
        if not self._paused:
            return list(self._by_ident.values())
        return [seq for i, seq in self._by_ident.items() if i not in self._paused]

    def iterate(self, advance: Callable[[list[S]], None], result: Callable[[S], Any],
                progress: bool = False) -> Deltas:
        """ONE step of every running sequence not paused: `advance(batch)` takes it; a sequence whose
        last step this was leaves with `Delta(stop_reason="completed", value=result(seq))`. With
        `progress`, every stepped sequence's delta carries its `progress` (a stream reports each step)."""
        batch = self.batch()
        if not batch:
            return {}
        started = time.perf_counter()
        advance(batch)  # the step's forward (what loop_timing counts as the forward; its batching included)
        out = Deltas(forward_s=time.perf_counter() - started)
        for ident, seq in list(self._by_ident.items()):
            if ident in self._paused:
                continue
            if seq.done:
                del self._by_ident[ident]
                out[ident] = Delta(stop_reason="completed", value=result(seq),
                                   progress=seq.progress if progress else None)
            elif progress:
                out[ident] = Delta(progress=seq.progress)
        return out

    def __getitem__(self, ident: int) -> S:
        return self._by_ident[ident]

    def __contains__(self, ident: object) -> bool:
        return ident in self._by_ident

    def __len__(self) -> int:
        return len(self._by_ident)

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_ident)
