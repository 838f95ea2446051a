"""Value sequences on one rank: a request that takes `steps` denoising steps, and the set of them
running, batched per step.

    running = Running()
    running.admit(7, Sequence(value=noise, steps=10))     # joins at the next step
    deltas = running.iterate(advance, result)             # advance(batch): ONE step of every sequence
                                                          # (each calls seq.took(new_value)); the ones
                                                          # whose last step this was leave with result(seq)

A sequence is what a value plugin's rank keeps per request between iterations of the iteration
protocol (`phyai_ray/plugins/iteration.py`): its value tensor (a noisy action chunk, video latents),
how many of its steps it has taken, and for streams its progress {"step": i, "of": n}. A plugin
subclasses `Sequence` for what its math adds (a prefix cache, a scheduler, RTC guidance); the
running set, the step counting and the deltas are written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

import torch

from phyai_ray.plugins.iteration import Delta


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

    def admit(self, ident: int, seq: S) -> None:
        """`seq` runs from the next step on; an ident already running starts again as `seq` in its place."""
        self._by_ident[ident] = seq
        if ident not in self._joining:
            self._joining.append(ident)

    def drop(self, ident: int) -> S | None:
        """Forget `ident` (before its last step); the sequence it was, or None."""
        if ident in self._joining:
            self._joining.remove(ident)
        return self._by_ident.pop(ident, None)

    def joined(self) -> list[S]:
        """The sequences admitted since the last call, in order (each is returned once)."""
        joined, self._joining = [self._by_ident[i] for i in self._joining if i in self._by_ident], []
        return joined

    def batch(self) -> list[S]:
        """Every running sequence, in admission order."""
        return list(self._by_ident.values())

    def iterate(self, advance: Callable[[list[S]], None], result: Callable[[S], Any],
                progress: bool = False) -> dict[int, Delta]:
        """ONE step of every running sequence: `advance(batch)` takes it; a sequence whose last step this
        was leaves with `Delta(stop_reason="completed", value=result(seq))`. With `progress`, every
        sequence's delta carries its `progress` (a stream reports each step)."""
        if not self._by_ident:
            return {}
        advance(self.batch())
        out: dict[int, Delta] = {}
        for ident, seq in list(self._by_ident.items()):
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
