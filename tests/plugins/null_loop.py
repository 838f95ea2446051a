"""`null_loop`: a continuous-batching plugin with no math, for measuring the engine's own loop.

    {"steps": n} -> one sequence of n tokens (each 0, log-prob 0.0); admit / iterate only count

`benchmarks/bench_loop.py` runs it from 1 to 1,024 sequences; tests/test_loop_timing.py builds a timed
variant on it.
"""

from __future__ import annotations

from typing import Any

from phyai_ray import Entry, register_plugin
from phyai_ray.plugins.iteration import Delta, SequenceSpec


class NullLoop:
    """A per-rank model with no math: each iteration gives every running sequence one token."""

    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        self.left: dict[int, int] = {}

    def admit(self, ident: int, payload: int) -> None:
        self.left[ident] = payload

    def drop(self, ident: int) -> None:
        self.left.pop(ident, None)

    def recompute(self, ident: int) -> None:
        pass

    def iterate(self) -> dict[int, Delta]:
        out = {}
        for ident, left in list(self.left.items()):
            done = left <= 1
            out[ident] = Delta([0], [0.0], "length" if done else None)
            if done:
                del self.left[ident]
            else:
                self.left[ident] = left - 1
        return out

    def step(self, request: Any) -> Any:
        raise RuntimeError("null_loop runs per iteration only")


@register_plugin
class NullLoopEntry(Entry):
    """`null_loop`: {"steps": n} -> one sequence of n tokens, each iteration free of math."""

    name = "null_loop"

    def validate_request(self, request: Any) -> None:
        if not isinstance(request, dict) or int(request.get("steps", 0)) < 1:
            raise ValueError(f"null_loop expects {{'steps': n >= 1}}, got {request!r:.60}")

    def sequences(self, request: dict[str, Any]) -> list[SequenceSpec]:
        return [SequenceSpec(int(request["steps"]), 1, steps=int(request["steps"]))]

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> NullLoop:
        return NullLoop(plugin_args, ctx)
