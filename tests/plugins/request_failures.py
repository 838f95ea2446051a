"""`fail_probe`: iter_probe whose requests can ask to fail alone, in each of the ways a plugin reports it.

    {"prompts": [[3, 4]], "max_tokens": 4, "fail": "admit"}    admit() raises MarkedError on every rank
    ... "fail": "admit_rank1"  admit() raises MarkedError on rank 1 only (rank 0 admits it)
    ... "fail": "oom"          admit() raises torch.OutOfMemoryError on every rank
    ... "fail": "delta"        its second iteration ends it with Delta(stop_reason="error", error=MarkedError)
    ... "fail": "sequence"     its second iteration raises SequenceError({its id: MarkedError}) on every rank
    ... "fail": "iterate_oom"  the first iteration it runs in raises torch.OutOfMemoryError (one rank only)
    ... "refuse": true         the validator raises OwnPluginError (the plugin's own class), before any rank

Each marked failure names the sequence, never the request's prompt. `no_sleep` is a step plugin whose
per-rank model is no torch module and defines no sleep: `sleep()` must refuse it.
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray import Entry, register_plugin
from phyai_ray.plugins.iteration import Delta, SequenceError
from tests.plugins.iterating import IterProbe, IterProbeEntry


class MarkedError(ValueError):
    """A request that asked to fail (its own error: it reaches the caller as this class)."""


class OwnPluginError(ValueError):
    """The plugin's own refusal class, raised by its validator."""


class FailProbe(IterProbe):
    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        super().__init__(plugin_args, ctx)
        self.rank = ctx.rank

    def admit(self, ident: int, payload: dict[str, Any]) -> None:
        if payload.get("fail") == "admit" or (payload.get("fail") == "admit_rank1" and self.rank == 1):
            raise MarkedError(f"sequence {ident} was marked to fail in admit")
        if payload.get("fail") == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (a stand-in)")
        super().admit(ident, payload)
        self.running[ident]["fresh"] = True

    def iterate(self) -> dict[int, Delta]:
        marked = {i: s for i, s in self.running.items() if s.get("fail") and s["made"] == 1}
        if any(s["fail"] == "sequence" for s in marked.values()):
            for ident in marked:
                self.running.pop(ident)
            raise SequenceError({i: MarkedError(f"sequence {i} failed in iterate") for i in marked})
        if any(s.get("fail") == "iterate_oom" and s["fresh"] for s in self.running.values()):
            raise torch.OutOfMemoryError("CUDA out of memory in the shared forward (a stand-in)")
        failed = {i: Delta(stop_reason="error", error=MarkedError(f"sequence {i} failed in its decode"))
                  for i, s in marked.items() if s["fail"] == "delta"}
        for ident in failed:
            self.running.pop(ident)
        for seq in self.running.values():
            seq["fresh"] = False
        return {**super().iterate(), **failed}


@register_plugin
class FailProbeEntry(IterProbeEntry):
    name = "fail_probe"

    def validate_request(self, request: Any) -> None:
        if isinstance(request, dict) and request.get("refuse"):
            raise OwnPluginError("fail_probe refuses requests with 'refuse' set")
        super().validate_request(request)

    def sequences(self, request: dict[str, Any]) -> list:
        specs = super().sequences(request)
        for spec in specs:
            spec.payload.update({k: request[k] for k in ("fail",) if k in request})
        return specs

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> FailProbe:
        return FailProbe(plugin_args, ctx)


class PlainModel:
    """No torch module, no sleep: nothing a sleep could free."""

    def step(self, request: Any) -> Any:
        return request


@register_plugin
class NoSleepEntry(Entry):
    name = "no_sleep"

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> PlainModel:
        return PlainModel()
