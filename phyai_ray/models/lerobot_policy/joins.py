"""Joining frames' prefix passes as a phase of each iteration, with a work budget, so joins do not stall
the robots already running.

    phase = PrefixPhase(net, budget=None, batch_prefixes=True)
    phase.run(waiting)        # each iteration, before the expert step: waiting frames' prefixes
    ready = [f for f in frames if f.prefix is not None]     # only these take the step

Without a budget (the default) every waiting frame's prefix runs whole in this iteration: the frames
admitted together in ONE VLM pass (or one pass per frame with batch_prefixes off). With
plugin_args["prefix_budget"] = n, the joining frames are grouped into passes whose one layer fits n
(at least one frame a pass), and an iteration runs layers of those passes until n units of work are
done (a unit: one token through one layer, SigLIP's or the VLM's), at least one layer, and never
starting a layer that would overrun it (a layer is expected to cost what the pass's last one did):
a pass larger than the budget goes on in the next iterations, where it stopped (the network's
`prefix_steps` yields after each layer; a network without it runs its pass whole, as one step). A
frame takes its first expert step in the iteration its prefix completes; the running robots step
every iteration meanwhile, each iteration's extra work bounded by the budget (plus one layer).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Generator

import torch


class PrefixPhase:
    """The prefix passes in progress on one rank (see the module docstring)."""

    def __init__(self, net: torch.nn.Module, budget: int | None = None, batch_prefixes: bool = True) -> None:
        self.net, self.budget, self.batch_prefixes = net, budget, batch_prefixes
        self.passes: Counter[int] = Counter()  # {frames in one VLM prefix pass: how many such passes}
        self.work: list[int] = []  # the units of prefix work of each recent iteration that did some
        self._pass: tuple[list[Any], Generator[int, None, list[Any]]] | None = None
        self._next = 0  # the units the pass in progress is expected to spend on its next layer

    def run(self, waiting: list[Any]) -> None:
        """Prefix work for `waiting` (frames with no prefix yet) within this iteration's budget."""
        spent = 0
        started = {id(f) for f in self._pass[0]} if self._pass else set()
        queue = [f for f in waiting if id(f) not in started]
        groups = self._groups(queue)
        while self._pass is not None or groups:
            if self._pass is None:
                group = groups.pop(0)
                self._pass, self._next = (group, self._steps(group)), self._need(group)
            if self.budget is not None and spent and spent + self._next > self.budget:
                break  # the next layer would overrun the budget: it runs in the next iteration
            try:
                self._next = next(self._pass[1])
                spent += self._next
            except StopIteration as stop:
                group, self._pass = self._pass[0], None
                for frame, prefix in zip(group, stop.value):
                    frame.prefix, frame.inputs = prefix, None
                self.passes[len(group)] += 1
        if spent:
            self.work = [*self.work[-255:], spent]

    def _groups(self, frames: list[Any]) -> list[list[Any]]:
        """The passes for `frames`: one (batch_prefixes), one per frame, or with a budget as many frames
        per pass as one layer of theirs fits the budget (at least one), so no layer step overruns it."""
        if not frames:
            return []
        if not self.batch_prefixes:
            return [[f] for f in frames]
        if self.budget is None:
            return [frames]
        groups, tokens = [[]], 0
        for frame in frames:
            need = self._need([frame])
            if groups[-1] and tokens + need > self.budget:
                groups, tokens = [*groups, []], 0
            groups[-1].append(frame)
            tokens += need
        return groups

    def _need(self, frames: list[Any]) -> int:
        """The units of the largest layer of one pass of `frames`: a SigLIP layer's rows (their
        cameras' tokens) or a VLM layer's (images and prompt)."""
        per_image, need = getattr(self.net, "image_tokens", lambda: 0)(), 0
        for frame in frames:
            images, ids = frame.inputs
            need += max(per_image * len(images), per_image + len(ids))
        return need

    def reset(self) -> None:
        """Forget the pass in progress (after a weight update its layers so far are stale; the loop
        starts its frames again)."""
        self._pass = None

    def _steps(self, group: list[Any]) -> Generator[int, None, list[Any]]:
        images, tokens = zip(*(f.inputs for f in group))
        states = torch.stack([f.state for f in group])
        steps = getattr(self.net, "prefix_steps", None)
        if steps is not None:
            return (yield from steps(list(images), list(tokens), states))
        prefixes = self.net.encode_prefixes(list(images), list(tokens), states)
        yield sum(p.length for p in prefixes) * getattr(self.net, "num_vlm_layers", 1)
        return prefixes
