"""One request to the reference transformer, and the checks that run before any rank sees it.

    {"tokens": [[3, 1, 4, 1], [5, 9, 2, 6]],   # LongTensor [B, S] or nested list of ints
     "labels": [7, 2],                          # optional condition label per sample (default 0)
     "guidance_scale": 4.0}                     # optional; None runs the conditional branch only

With guidance the result is `uncond + scale * (cond - uncond)`, where the conditional branch adds
the label's embedding to every token and the unconditional one adds the null label's embedding.
The result is float32 logits [B, S, vocab].

Request-time layout rules (the numbers depend on the request, not on the model):

    B % attention.dp == 0  (explicit)     B % dense.dp == 0 (explicit)     B % moe.dp == 0 (explicit)
    S % attention.cp == 0                 S <= max_seq
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from phyai_ray.models.reference_dit.config import ReferenceDiTConfig


class ReferenceDiTRequest(BaseModel):
    """JSON body of one request (the HTTP shape of what `step` accepts)."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]] = Field(
        min_length=1, description="Token ids [B, S], every row the same length, 0 <= id < vocab.")
    labels: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="Condition label per sample [B], 0 <= label < classes.")
    guidance_scale: float | None = Field(None, description="Classifier-free guidance scale; None disables it.")


@dataclass(frozen=True)
class ParsedRequest:
    """A checked request: tokens [B, S] int64, labels [B] int64, optional guidance scale."""

    tokens: torch.Tensor
    labels: torch.Tensor
    guidance_scale: float | None

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq(self) -> int:
        return self.tokens.shape[1]


def parse_request(request: Any, cfg: ReferenceDiTConfig) -> ParsedRequest:
    """Check a request dict against the model shape; raise `ValueError`/`TypeError` with the values."""
    if not isinstance(request, dict):
        raise TypeError(f"reference_dit expects a dict like {{'tokens': [[1, 2]], 'guidance_scale': 4.0}}, "
                        f"got {type(request).__name__}")
    unknown = set(request) - set(ReferenceDiTRequest.model_fields)
    if unknown:
        raise ValueError(f"unknown request keys {sorted(unknown)}; known: {sorted(ReferenceDiTRequest.model_fields)}")
    if "tokens" not in request:
        raise ValueError("request has no 'tokens'; pass a LongTensor [B, S] or a nested list of ints")
    tokens = _int_tensor(request["tokens"], "tokens", ndim=2)
    _check_range(tokens, "tokens", cfg.vocab, "vocab")
    if tokens.shape[1] > cfg.max_seq:
        raise ValueError(f"tokens has sequence length {tokens.shape[1]} > max_seq={cfg.max_seq}; "
                         "shorten it or raise plugin_args['max_seq']")
    labels = request.get("labels")
    labels = torch.zeros(tokens.shape[0], dtype=torch.int64) if labels is None else _int_tensor(labels, "labels", 1)
    if labels.shape[0] != tokens.shape[0]:
        raise ValueError(f"labels has {labels.shape[0]} entries but tokens has batch {tokens.shape[0]}")
    _check_range(labels, "labels", cfg.classes, "classes")
    return ParsedRequest(tokens, labels, _scale(request.get("guidance_scale")))


def check_request(request: Any, cfg: ReferenceDiTConfig) -> tuple[int, int]:
    """`parse_request`'s checks, without building tensors when the ids are nested lists: (batch, seq).

    The dispatcher runs this for every request, on the caller's thread; torch calls there would
    release and re-take the GIL several times per request, which slows every other thread."""
    if not isinstance(request, dict) or not isinstance(request.get("tokens"), list) or \
            not isinstance(request.get("labels", []), (list, type(None))):
        parsed = parse_request(request, cfg)
        return parsed.batch, parsed.seq
    unknown = set(request) - set(ReferenceDiTRequest.model_fields)
    if unknown:
        raise ValueError(f"unknown request keys {sorted(unknown)}; known: {sorted(ReferenceDiTRequest.model_fields)}")
    tokens = request["tokens"]
    if not tokens or not all(type(row) is list and row and len(row) == len(tokens[0]) for row in tokens) or \
            not all(type(v) is int for row in tokens for v in row):
        parsed = parse_request(request, cfg)  # the tensor path names what is wrong
        return parsed.batch, parsed.seq
    batch, seq = len(tokens), len(tokens[0])
    _check_values(min(min(row) for row in tokens), max(max(row) for row in tokens), "tokens", cfg.vocab, "vocab")
    if seq > cfg.max_seq:
        raise ValueError(f"tokens has sequence length {seq} > max_seq={cfg.max_seq}; "
                         "shorten it or raise plugin_args['max_seq']")
    labels = request.get("labels")
    if labels is not None:
        if not all(type(v) is int for v in labels):
            parse_request(request, cfg)
        if len(labels) != batch:
            raise ValueError(f"labels has {len(labels)} entries but tokens has batch {batch}")
        _check_values(min(labels), max(labels), "labels", cfg.classes, "classes")
    _scale(request.get("guidance_scale"))
    return batch, seq


def parse_batch(requests: list[Any], cfg: ReferenceDiTConfig) -> tuple[ParsedRequest, list[int]]:
    """Requests of one batch key as ONE parsed request (samples in order) and each one's samples.

    Nested lists are joined first and turned into tensors once; tensors are parsed one by one."""
    if all(isinstance(r, dict) and isinstance(r.get("tokens"), list) and isinstance(r.get("labels"), (list, type(None)))
           for r in requests):
        rows = [row for r in requests for row in r["tokens"]]
        labels = [v for r in requests for v in (r.get("labels") or [0] * len(r["tokens"]))]
        joined = parse_request({"tokens": rows, "labels": labels, "guidance_scale": requests[0].get("guidance_scale")},
                               cfg)
        return joined, [len(r["tokens"]) for r in requests]
    parsed = [parse_request(r, cfg) for r in requests]
    return join_requests(parsed), [p.batch for p in parsed]


def batch_key(request: dict) -> tuple:
    """What requests must share to run as one forward: the sequence length and the guidance scale."""
    tokens = request["tokens"]
    seq = tokens.shape[1] if isinstance(tokens, torch.Tensor) else len(tokens[0])
    return seq, _scale(request.get("guidance_scale"))


def request_size(request: dict) -> int:
    """Samples in a request: the batch dimension of its tokens."""
    tokens = request["tokens"]
    return int(tokens.shape[0]) if isinstance(tokens, torch.Tensor) else len(tokens)


def join_requests(parsed: list[ParsedRequest]) -> ParsedRequest:
    """Requests of one batch key as one: samples concatenated in order."""
    keys = {(p.seq, p.guidance_scale) for p in parsed}
    if len(keys) != 1:
        raise ValueError(f"reference_dit can batch only requests of one sequence length and guidance scale, got "
                         f"{sorted(keys, key=str)}; batch_key keeps them apart")
    if len(parsed) == 1:
        return parsed[0]
    return ParsedRequest(torch.cat([p.tokens for p in parsed]), torch.cat([p.labels for p in parsed]),
                         parsed[0].guidance_scale)


def check_layout(parsed: ParsedRequest, parallel: Any) -> None:
    """Raise `ValueError` when batch or sequence do not split evenly over the topology."""
    splits = [("sequence", parsed.seq, "attention.cp_size", parallel.attention.cp_size)]
    for domain in ("attention", "dense", "moe"):
        if domain in parallel.explicit_domains:
            splits.append(("batch", parsed.batch, f"{domain}.dp_size", getattr(parallel, domain).dp_size))
    bad = [f"{what} {n} is not divisible by {axis}={size}" for what, n, axis, size in splits if n % size]
    if bad:
        raise ValueError(f"request does not fit the topology {parallel.describe()}: {'; '.join(bad)}; "
                         "pad the request or pick other degrees")


def _int_tensor(value: Any, name: str, ndim: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a {value.dtype} tensor")
        tensor = value.detach().to("cpu", torch.int64)
    else:
        try:
            tensor = torch.tensor(value, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name} must be a tensor or a rectangular nested list of ints: {exc}") from None
    if tensor.ndim != ndim or 0 in tensor.shape:
        want = "[B, S]" if ndim == 2 else "[B]"
        raise ValueError(f"{name} must have shape {want} with no empty dimension, got {list(tensor.shape)}")
    return tensor


def _check_range(tensor: torch.Tensor, name: str, limit: int, field: str) -> None:
    _check_values(int(tensor.min()), int(tensor.max()), name, limit, field)


def _check_values(low: int, high: int, name: str, limit: int, field: str) -> None:
    if low < 0 or high >= limit:
        raise ValueError(f"{name} values must lie in [0, {limit}) ({field}={limit}), got min {low}, max {high}")


def _scale(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"guidance_scale must be a finite number or None, got {value!r}")
    return float(value)
