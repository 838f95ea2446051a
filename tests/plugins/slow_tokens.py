"""`slow_tokens`: a token plugin that streams one token per `delay_s` and records how each stream ended.

Token i of every prompt is i; `SlowTokens.ended` collects (tokens emitted, whether the consumer
stopped it) for each stream, so a test sees when a disconnect reached the plugin (inline engines).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from phyai_ray import Entry
from phyai_ray.outputs import TokenOutput


class SlowTokens:
    ended: list[tuple[int, bool]] = []
    ended_changed = threading.Condition()

    def __init__(self, plugin_args: dict[str, Any], ctx: Any) -> None:
        self.delay_s = float(plugin_args.get("delay_s", 0.1))

    def step(self, request: dict[str, Any]) -> list[TokenOutput]:
        return self.stream(request, lambda chunk: True)

    def stream(self, request: dict[str, Any], emit: Any) -> list[TokenOutput]:
        prompts, emitted, stopped = request["prompts"], 0, False
        for i in range(request["max_tokens"]):
            time.sleep(self.delay_s)
            if not emit({"token_ids": [i] * len(prompts), "log_probs": [0.0] * len(prompts)}):
                stopped = True
                break
            emitted += 1
        with SlowTokens.ended_changed:
            SlowTokens.ended.append((emitted, stopped))
            SlowTokens.ended_changed.notify_all()
        return [TokenOutput(list(range(emitted)), [0.0] * emitted, stop_reason="length") for _ in prompts]


class SlowTokensEntry(Entry):
    name = "slow_tokens"
    generates_tokens = True

    def create(self, plugin_args: dict[str, Any], ctx: Any) -> SlowTokens:
        return SlowTokens(plugin_args, ctx)
