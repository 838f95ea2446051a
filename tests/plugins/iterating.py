"""`iter_probe`: a plugin with the iteration protocol that records every plan on every rank.

    {"prompts": [[3, 4], [5]], "max_tokens": 4, "sleep": 0.0, "raise_at": -1}
    -> one TokenOutput per prompt: token i of a sequence is 1000 * scale + 10 * len(prompt) + i

Each iteration all-reduces a checksum of the running sequence ids over `dense_tp`, so `agreed()`
says every rank ran the same iterations with the same sequences; `plans()` is a rank's history of
(admitted, dropped, recomputed) ids. `scale` is a parameter of an `nn.Module`: the default
weight-update hooks replace it, so a token shows which weights produced it. "sleep" slows each
iteration a sequence runs in; "raise_at": i makes the iteration giving its token i raise.

`iter_groups` (IterGroupsEntry) is the same model run as value sequences with its own admission
policy: sequences grouped by prompt length, at most one group and a cost of 6 per iteration.
"""

from __future__ import annotations

import threading
import time
import zlib
from typing import Any

import torch

from phyai_ray import Entry, P, register_plugin
from phyai_ray.plugins.admission import CostBudget, GroupLimit
from phyai_ray.plugins.iteration import Delta, SequenceSpec


class IterProbe(torch.nn.Module):
    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)
        self.running: dict[int, dict[str, Any]] = {}
        self.history: list[tuple[list[int], list[int], list[int]]] = []
        self.agreement: list[bool] = []
        self.groups: list[list[int]] = []  # per iteration, the prompt length of every running sequence
        self._pending: tuple[list[int], list[int], list[int]] = ([], [], [])

    def admit(self, ident: int, payload: dict[str, Any]) -> None:
        self.running[ident] = {**payload, "made": 0}
        self._pending[0].append(ident)

    def drop(self, ident: int) -> None:
        self.running.pop(ident, None)
        self._pending[1].append(ident)

    def recompute(self, ident: int) -> None:
        self._pending[2].append(ident)

    @torch.no_grad()
    def iterate(self) -> dict[int, Delta]:
        self.history.append(self._pending)
        self.groups.append(sorted(len(s["prompt"]) for s in self.running.values()))
        self._pending = ([], [], [])
        ids = sorted(self.running)
        mine = torch.tensor([float(len(ids)), float(zlib.crc32(str(ids).encode()) % 99991)], dtype=torch.float64)
        self.agreement.append(bool(torch.equal(P.all_reduce(mine.clone(), group="dense_tp"),
                                               mine * P.size("dense_tp"))))
        pause = max((float(s.get("sleep", 0.0)) for s in self.running.values()), default=0.0)
        if pause:
            time.sleep(pause)
        if any(s.get("raise_at", -1) == s["made"] for s in self.running.values()):
            raise RuntimeError("iterate asked to raise")
        out = {}
        scale = int(self.scale.item())
        for ident in ids:
            seq = self.running[ident]
            token = 1000 * scale + 10 * len(seq["prompt"]) + seq["made"]
            seq["made"] += 1
            done = "length" if seq["made"] >= seq["max_tokens"] else None
            if seq.get("value"):  # iter_groups: a value at the end, no tokens
                out[ident] = Delta(stop_reason=done, value={"scale": scale, "made": seq["made"]} if done else None)
            else:
                out[ident] = Delta([token], [-float(seq["made"])], done)
            if done:
                del self.running[ident]
        return out

    def step(self, request: dict[str, Any]) -> Any:
        raise RuntimeError("iter_probe runs per iteration only")

    def plans(self) -> list[tuple[list[int], list[int], list[int]]]:
        return [tuple(list(x) for x in p) for p in self.history]

    def ran(self) -> list[list[int]]:
        return [list(g) for g in self.groups]

    def agreed(self) -> bool:
        return all(self.agreement)

    def slots(self) -> int:
        return len(self.running)


@register_plugin
class IterProbeEntry(Entry):
    name = "iter_probe"
    parallel_domains = frozenset({"dense"})

    def validate_request(self, request: Any) -> None:
        if not isinstance(request, dict) or not request.get("prompts"):
            raise ValueError(f"iter_probe request needs non-empty 'prompts'; got {request!r:.80}")

    def sequences(self, request: dict[str, Any]) -> list[SequenceSpec]:
        extra = {k: request[k] for k in ("sleep", "raise_at") if k in request}
        return [SequenceSpec({"prompt": list(p), "max_tokens": int(request.get("max_tokens", 4)), **extra}, len(p))
                for p in request["prompts"]]

    def gather(self, request: dict[str, Any], outputs: list[Any]) -> Any:
        """As the default; with "gather_s", it sets GATHERING and takes that long (plugin code the loop runs)."""
        if request.get("gather_s"):
            GATHERING.set()
            time.sleep(request["gather_s"])
        return outputs

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> IterProbe:
        return IterProbe(plugin_args, ctx)


@register_plugin
class IterGroupsEntry(IterProbeEntry):
    """`iter_groups`: iter_probe's sequences ending in a value {"scale", "made"} instead of tokens, each
    in the group of its prompt's length, admitted at most one group and 6 prompt ids per iteration."""

    name = "iter_groups"

    def sequences(self, request: dict[str, Any]) -> list[SequenceSpec]:
        return [SequenceSpec({"prompt": list(p), "max_tokens": int(request.get("max_tokens", 4)), "value": True},
                             cost=len(p), group=len(p)) for p in request["prompts"]]

    def admission(self, batching: Any) -> GroupLimit:
        return GroupLimit(CostBudget(batching.max_num_seqs, 6), max_groups=1)


GATHERING = threading.Event()  # set by a gather that takes its time (test_iterations)
