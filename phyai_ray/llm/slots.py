"""Running sequences of a slot decoder and their KV cache: one slot (cache row) per sequence.

    slots = Slots(layers=2, heads=4, head_dim=16, max_seq=256, to={"device": cpu, "dtype": torch.float32})
    slots.admit(7, {"prompt": [1, 2, 3], "max_tokens": 4, ...})   # fed at the next iteration
    batch = slots.batch(device)                  # every running sequence's new tokens, one forward
    ...the model writes k/v at (batch.rows, batch.positions) of slots.layer(i), attends, samples...
    deltas = slots.advance(chosen, log_probs)    # {7: Delta([t], [lp], None)}; finished ones leave

Every layer's keys and values are [rows, heads, max_seq, head_dim] tensors, preallocated and doubled
when full. The running sequences stay packed in rows 0..B-1 (a freed row takes the last row's cache),
so an iteration reads `keys[:B, :, :T]`, a view, with T the longest sequence after its writes.
Sequence i's token at position p lives in column p of row i. With cached lengths [5, 0] and new
tokens [[t], [a, b, c]] (a decode, and a recompute of a 3-token history), S = 3, T = 6, and the mask
of row 1 is

    query a: keys 0        query b: keys 0..1        query c: keys 0..2        (row 0's pads: keys 0..5)

Sampling (`phyai_ray.llm.sampler`, re-exported here) is per sequence and on the logits' device:
greedy rows by argmax, sampled rows from a hash of their own seed, so a seeded sequence draws the
same tokens whatever runs beside it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from phyai_ray.llm.sampler import alternatives, draw, sample  # noqa: F401 (importers of slots keep working)
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
    row: int = -1
    stop_reason: str | None = None
    top_logprobs: int = 0  # how many alternatives each token reports (0: none)
    tops: list[dict[int, float]] = field(default_factory=list)
    scan: Any = None  # a `StopScan` when the payload gave stop_strings: the token completing one ends it

    @classmethod
    def from_payload(cls, seq_id: int, payload: dict[str, Any], max_seq: int, vocab: int) -> "Running":
        _check_payload(seq_id, payload, max_seq, vocab)
        prompt = [int(t) for t in payload["prompt"]]
        generator = torch.Generator().manual_seed(int(payload["seed"]))
        return cls(seq_id, prompt, int(payload["max_tokens"]), float(payload["temperature"]), int(payload["top_k"]),
                   float(payload["top_p"]), frozenset(payload["stop_token_ids"]), generator, pending=list(prompt),
                   top_logprobs=int(payload.get("top_logprobs") or 0))

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
        return Delta([token], [log_prob], self.stop_reason, [top] if top is not None else [])


def _check_payload(seq_id: int, payload: dict[str, Any], max_seq: int, vocab: int) -> None:
    missing = [k for k in PAYLOAD_KEYS if k not in payload]
    if missing:
        raise ValueError(f"reference_lm admit({seq_id}): payload lacks {missing}; it needs {list(PAYLOAD_KEYS)} "
                         "(GenerateRequest.payloads() builds it)")
    prompt, max_tokens = payload["prompt"], payload["max_tokens"]
    if not prompt or not all(0 <= t < vocab for t in prompt) or max_tokens < 1 or len(prompt) + max_tokens > max_seq:
        raise ValueError(f"reference_lm admit({seq_id}): the prompt must be non-empty with ids in [0, {vocab}), "
                         f"max_tokens >= 1 and prompt + max_tokens <= max_seq={max_seq}; got {len(prompt)} prompt "
                         f"id(s) and max_tokens={max_tokens}")


@dataclass(frozen=True)
class Batch:
    """One iteration's new tokens: N real tokens in row order; attention pads them to [B, S] queries.

    `pad` is the index of each real token in the padded [B * S] (None when no row is padded);
    `last` the index (in N) of each row's last new token, whose logits choose its next token.
    """

    tokens: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]: its position in its sequence = its cache column
    rows: torch.Tensor  # [N]: its cache row
    pad: torch.Tensor | None  # [N]
    hidden: torch.Tensor  # [B, 1, S, T] bool: query s of row b must not see key column j
    last: torch.Tensor  # [B]
    size: int  # B
    width: int  # S

    @property
    def length(self) -> int:
        """T: the key columns this iteration attends over (the longest sequence after its writes)."""
        return self.hidden.shape[-1]

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """[N, heads, head_dim] -> [B, heads, S, head_dim], pad queries zero."""
        if self.pad is not None:
            x = x.new_zeros(self.size * self.width, *x.shape[1:]).index_copy_(0, self.pad, x)
        return x.view(self.size, self.width, *x.shape[1:]).transpose(1, 2)

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """[B, heads, S, head_dim] -> [N, heads * head_dim], the real tokens only."""
        x = x.transpose(1, 2).reshape(self.size * self.width, -1)
        return x if self.pad is None else x[self.pad]


class Slots:
    """The running sequences of one loop and their per-layer KV cache (see the module docstring)."""

    def __init__(self, *, layers: int, heads: int, head_dim: int, max_seq: int, vocab: int, to: dict,
                 rows: int = 8, stop_scan: Any = None) -> None:
        self.max_seq, self.vocab, self.to = max_seq, vocab, to
        self.stop_scan = stop_scan  # stop strings -> a `StopScan`; None: payloads may not give stop_strings
        self.shape = (heads, max_seq, head_dim)
        # zeros, not empty: a masked key's score is replaced, but 0 * NaN in a masked value would still be NaN
        self.keys = [torch.zeros(rows, *self.shape, **to) for _ in range(layers)]
        self.values = [torch.zeros(rows, *self.shape, **to) for _ in range(layers)]
        self.rows: list[Running] = []  # row i holds self.rows[i]
        self.by_id: dict[int, Running] = {}

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (keys, values), each [capacity, heads, max_seq, head_dim]."""
        return self.keys[i], self.values[i]

    def admit(self, seq_id: int, payload: dict[str, Any]) -> Running:
        seq = Running.admitted(seq_id, payload, max_seq=self.max_seq, vocab=self.vocab, running=self.by_id,
                               stop_scan=self.stop_scan)
        if len(self.rows) == self.capacity:
            self._grow(2 * self.capacity)
        seq.row = len(self.rows)
        self.rows.append(seq)
        self.by_id[seq_id] = seq
        return seq

    def drop(self, seq_id: int) -> None:
        """Forget a sequence and free its row; an unknown id is ignored."""
        seq = self.by_id.get(seq_id)
        if seq is not None:
            self._free(seq)

    def recompute(self, seq_id: int) -> None:
        """Feed the whole history (prompt + every token, the last one not yet fed) again at the next iteration."""
        seq = self.by_id.get(seq_id)
        if seq is not None:
            seq.cached, seq.pending = 0, seq.prompt + seq.tokens

    def batch(self, device: Any) -> Batch:
        """The next iteration of every running sequence (there must be one), in one copy to `device`."""
        spans = [(s.cached, len(s.pending)) for s in self.rows]  # (first new column, new tokens) per row
        size, width, length = len(spans), max(n for _, n in spans), max(c + n for c, n in spans)
        real = [(r, c + i, r * width + i) for r, (c, n) in enumerate(spans) for i in range(n)]
        rows, positions, pad = (list(column) for column in zip(*real))
        padded = len(real) < size * width
        sees = [min(c + i, c + n - 1) for c, n in spans for i in range(width)]  # the last key column a query sees
        parts = [[t for s in self.rows for t in s.pending], rows, positions, *([pad] if padded else []),
                 [n - 1 for n in accumulate(n for _, n in spans)], sees]
        packed = _tensor("q", [v for part in parts for v in part]).to(device).split([len(p) for p in parts])
        tokens, rows, positions, *pad, last, sees = packed
        hidden = torch.arange(length, device=device) > sees.view(size, 1, width, 1)
        return Batch(tokens, positions, rows, pad[0] if pad else None, hidden, last, size, width)

    def advance(self, chosen: list[int], log_probs: list[float],
                tops: list[dict[int, float] | None] | None = None) -> dict[int, Delta]:
        """Give row i its token chosen[i] (and its alternatives tops[i]); free the rows of the sequences that ended."""
        tops = tops or [None] * len(chosen)
        deltas = {s.seq_id: s.take(t, lp, top) for s, t, lp, top in zip(self.rows, chosen, log_probs, tops)}
        for seq in sorted((s for s in self.rows if s.stop_reason), key=lambda s: -s.row):
            self._free(seq)  # highest rows first: a freed last row needs no move
        return deltas

    def _free(self, seq: Running) -> None:
        """Forget `seq`; the last row moves into its row, so rows 0..B-1 stay packed."""
        del self.by_id[seq.seq_id]
        last = self.rows.pop()
        if last is not seq:
            n = last.cached
            for cache in self.keys + self.values:
                cache[seq.row, :, :n] = cache[last.row, :, :n]
            last.row = seq.row
            self.rows[seq.row] = last

    def _grow(self, rows: int) -> None:
        def grown(cache: torch.Tensor) -> torch.Tensor:
            new = torch.zeros(rows, *self.shape, **self.to)
            new[: cache.shape[0]] = cache
            return new

        self.keys, self.values = [grown(c) for c in self.keys], [grown(c) for c in self.values]


def _tensor(typecode: str, values: list) -> torch.Tensor:
    """A 1-d int64 ("q") or float32 ("f") tensor of `values`: ten times faster than torch.tensor(list)."""
    return torch.frombuffer(array(typecode, values), dtype=torch.int64 if typecode == "q" else torch.float32)
