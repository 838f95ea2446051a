"""One generating sequence: its sampling knobs, its seeded generator, its output so far, what it feeds next.

    seq = Running.from_payload(7, {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, "top_k": 0,
                                   "top_p": 1.0, "seed": 0, "stop_token_ids": [2]}, max_seq=256, vocab=128)
    seq.pending                # [1, 2, 3]: fed at the next iteration, from cache column seq.cached (0) on
    seq.take(17, -0.3)         # Delta([17], [-0.3], None); now pending == [17] and cached == 3

A payload is what a token plugin's request builds per prompt (`GenerateRequest.payloads()`) and
what `PagedSequences.admit` takes. `take` ends the sequence with "completed" at a stop token (or
the token that completes a stop string) and with "length" at `max_tokens`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from phyai_ray.plugins.iteration import Delta

PAYLOAD_KEYS = ("prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids")


@dataclass(eq=False)
class Running:
    """One sequence: its sampling parameters, generator, output so far, and what the next iteration feeds."""

    seq_id: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop: frozenset[int]
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # fed at the next iteration, from column `cached` on
    cached: int = 0  # tokens whose k/v are in the cache
    stop_reason: str | None = None
    top_logprobs: int = 0  # how many alternatives each token reports (0: none)
    tops: list[dict[int, float]] = field(default_factory=list)
    scan: Any = None  # a `StopScan` when the payload gave stop_strings: the token completing one ends it
    logit_bias: dict[int, float] = field(default_factory=dict)  # the processors of `phyai_ray.llm.logits`
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    processors: bool = False  # any of logit_bias and the penalties given (`phyai_ray.llm.logits.changes`)

    def __post_init__(self) -> None:
        self.processors = bool(self.logit_bias) or self.repetition_penalty != 1.0 or \
            self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @classmethod
    def from_payload(cls, seq_id: int, payload: dict[str, Any], max_seq: int, vocab: int) -> "Running":
        _check_payload(seq_id, payload, max_seq, vocab)
        prompt = [int(t) for t in payload["prompt"]]
        generator = torch.Generator().manual_seed(int(payload["seed"]))
        return cls(seq_id, prompt, int(payload["max_tokens"]), float(payload["temperature"]), int(payload["top_k"]),
                   float(payload["top_p"]), frozenset(payload["stop_token_ids"]), generator, pending=list(prompt),
                   top_logprobs=int(payload.get("top_logprobs") or 0),
                   logit_bias={int(k): float(v) for k, v in (payload.get("logit_bias") or {}).items()},
                   presence_penalty=float(payload.get("presence_penalty", 0.0)),
                   frequency_penalty=float(payload.get("frequency_penalty", 0.0)),
                   repetition_penalty=float(payload.get("repetition_penalty", 1.0)),
                   min_p=float(payload.get("min_p", 0.0)))

    @classmethod
    def admitted(cls, seq_id: int, payload: dict[str, Any], *, max_seq: int, vocab: int, running: Any,
                 stop_scan: Any = None) -> "Running":
        """A new sequence from its payload (checked), with its stop-string scan when the payload gives
        stop strings; `running` (the ids that run) must not hold `seq_id`."""
        if seq_id in running:
            raise ValueError(f"admit({seq_id}): sequence {seq_id} is already running; drop it first")
        seq = cls.from_payload(seq_id, payload, max_seq, vocab)
        if payload.get("stop_strings"):
            if stop_scan is None:
                raise ValueError(f"admit({seq_id}): the payload gives stop_strings, but this model has no tokenizer "
                                 "to find them with; send stop_token_ids")
            seq.scan = stop_scan(payload["stop_strings"])
        return seq

    def take(self, token: int, log_prob: float, top: dict[int, float] | None = None) -> Delta:
        """Record the token sampled for this sequence; it is fed at the next iteration unless this one ends."""
        self.cached += len(self.pending)
        self.tokens.append(token)
        self.log_probs.append(log_prob)
        self.pending = [token]
        if top is not None:
            self.tops.append(top)
        if token in self.stop or (self.scan is not None and self.scan.push(token)):
            self.stop_reason = "completed"
        elif len(self.tokens) >= self.max_tokens:
            self.stop_reason = "length"
        return Delta([token], [log_prob], self.stop_reason, [] if top is None else [top])


def _check_payload(seq_id: int, payload: dict[str, Any], max_seq: int, vocab: int) -> None:
    missing = [k for k in PAYLOAD_KEYS if k not in payload]
    if missing:
        raise ValueError(f"admit({seq_id}): payload lacks {missing}; it needs {list(PAYLOAD_KEYS)} "
                         "(the request's payloads() builds it)")
    prompt, max_tokens = payload["prompt"], payload["max_tokens"]
    if not prompt or not all(0 <= t < vocab for t in prompt) or max_tokens < 1 or len(prompt) + max_tokens > max_seq:
        raise ValueError(f"admit({seq_id}): the prompt must be non-empty with ids in [0, {vocab}), "
                         f"max_tokens >= 1 and prompt + max_tokens <= max_seq={max_seq}; got {len(prompt)} prompt "
                         f"id(s) and max_tokens={max_tokens}")


def tensor_of(typecode: str, values: list) -> torch.Tensor:
    """A 1-d int64 ("q") or float32 ("f") tensor of `values`: ten times faster than torch.tensor(list)."""
    return torch.frombuffer(array(typecode, values), dtype=torch.int64 if typecode == "q" else torch.float32)
