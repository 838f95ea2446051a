"""`TokenOutput`: what a token-generating plugin returns for one prompt (verl's rollout output).

    TokenOutput(token_ids=[17, 4, 99], log_probs=[-0.31, -1.2, -0.05], stop_reason="completed")

`log_probs[i]` is the log-probability of `token_ids[i]` under the model's own distribution (raw
logits: no temperature, top-k or top-p), the number an RL trainer recomputes and compares.
`stop_reason` is "completed" (a stop token, included in `token_ids`), "length" (max_tokens) or
"aborted". `extra_info` is accepted as an alias of `extra_fields` (the name in verl's notes).

`weight_versions[i]` is the weight version that produced `token_ids[i]` (a sequence that ran across
a weight update has several; a trainer bounds staleness with `min_weight_version` or corrects
off-policy tokens one by one); `weight_version` is the last token's. Empty when the plugin ran
the request as one step (every token then has `weight_version`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STOP_REASONS = ("completed", "length", "aborted")


@dataclass
class TokenOutput:
    token_ids: list[int]
    log_probs: list[float]
    routed_experts: Any = None  # per token, the experts an MoE variant routed it to; None without MoE
    stop_reason: str = "length"
    num_preempted: int = 0
    weight_version: Any = None
    extra_fields: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[Any] = field(default_factory=list)
    text: str | None = None  # the completion decoded, when the request gave text (a plugin with a tokenizer)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per token {id: log-prob}, when asked

    def __init__(self, token_ids: list[int], log_probs: list[float], routed_experts: Any = None,
                 stop_reason: str = "length", num_preempted: int = 0, weight_version: Any = None,
                 extra_fields: dict[str, Any] | None = None, extra_info: dict[str, Any] | None = None,
                 weight_versions: list[Any] | None = None, text: str | None = None,
                 top_logprobs: list[dict[int, float]] | None = None) -> None:
        if stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason={stop_reason!r} must be one of {STOP_REASONS}")
        if len(log_probs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} token id(s) but {len(log_probs)} log-prob(s); give one per token")
        if extra_fields is not None and extra_info is not None:
            raise ValueError("give extra_fields or its alias extra_info, not both")
        self.token_ids, self.log_probs, self.routed_experts = list(token_ids), list(log_probs), routed_experts
        self.stop_reason, self.num_preempted, self.weight_version = stop_reason, num_preempted, weight_version
        self.extra_fields = dict(extra_fields if extra_fields is not None else extra_info or {})
        self.weight_versions = list(weight_versions or [])
        self.text = text
        self.top_logprobs = list(top_logprobs or [])
        if self.weight_versions and len(self.weight_versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token id(s) but {len(self.weight_versions)} weight version(s); "
                             "give one per token, or none")

    @property
    def extra_info(self) -> dict[str, Any]:
        return self.extra_fields

    @property
    def min_weight_version(self) -> Any:
        """The oldest weights any token came from (`weight_version` without per-token versions)."""
        return min(self.weight_versions, key=version_order) if self.weight_versions else self.weight_version

    @property
    def max_weight_version(self) -> Any:
        return max(self.weight_versions, key=version_order) if self.weight_versions else self.weight_version

    def to_dict(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "log_probs": self.log_probs, "routed_experts": self.routed_experts,
                "stop_reason": self.stop_reason, "num_preempted": self.num_preempted,
                "weight_version": self.weight_version, "weight_versions": self.weight_versions,
                "extra_fields": self.extra_fields, **({"text": self.text} if self.text is not None else {}),
                **({"top_logprobs": self.top_logprobs} if self.top_logprobs else {})}


def version_order(version: Any) -> Any:
    """Versions compare as themselves when they can (numbers); otherwise as text (None first)."""
    if version is None:
        return (0, 0)
    return (1, version) if isinstance(version, (int, float)) else (2, str(version))


# -- the token chunk: one streamed step of a token request ----------------------------------------
#   {"index": k, "token_ids": [entry per sequence], "log_probs": [entry per sequence],
#    "top_logprobs": [entry per sequence] (only when asked for)}
# An entry is None (that sequence had no token this step), one value (one token), or a list (several:
# a slow reader's folded steps, or an iteration that gave more). Built and read only here.

def token_chunk(index: int, deltas: list[Any]) -> dict[str, Any]:
    """The chunk of one step from each sequence's Delta (None: no token this step), in sequence order."""
    def entry(values: list) -> Any:
        return values[-1] if len(values) == 1 else list(values)
    chunk: dict[str, Any] = {
        "index": index,
        "token_ids": [entry(d.token_ids) if d is not None and d.token_ids else None for d in deltas],
        "log_probs": [entry(d.log_probs) if d is not None and d.token_ids else None for d in deltas]}
    tops = [(d.top_logprobs or None) if d is not None else None for d in deltas]
    if any(t is not None for t in tops):
        chunk["top_logprobs"] = tops  # per sequence: a list of {id: log-prob}, one per token of this chunk
    return chunk


def merge_token_chunks(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive chunks of one stream as one (each sequence's tokens, in order)."""
    def joined(a: Any, b: Any) -> Any:
        if a is None or b is None:
            return b if a is None else a
        return entry_values(a) + entry_values(b)
    out = {"index": first["index"], "token_ids": [joined(a, b) for a, b in zip(first["token_ids"], then["token_ids"])],
           "log_probs": [joined(a, b) for a, b in zip(first["log_probs"], then["log_probs"])]}
    if "top_logprobs" in first or "top_logprobs" in then:
        n = len(first["token_ids"])
        out["top_logprobs"] = [joined(a, b) for a, b in zip(first.get("top_logprobs") or [None] * n,
                                                             then.get("top_logprobs") or [None] * n)]
    return out


def merge_stream_chunks(first: Any, then: Any) -> Any:
    """Fold two consecutive chunks of an iteration stream: token chunks join their tokens; a value
    stream's reports (progress) keep the latest, since each one supersedes the one before."""
    if isinstance(first, dict) and isinstance(then, dict) and "token_ids" in first and "token_ids" in then:
        return merge_token_chunks(first, then)
    return then


def entry_values(entry: Any) -> list:
    """A chunk entry as the list of its values ([] for None)."""
    if entry is None:
        return []
    return list(entry) if isinstance(entry, (list, tuple)) else [entry]
