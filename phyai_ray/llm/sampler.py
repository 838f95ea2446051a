"""Sampling on the device where the logits are: only the chosen tokens cross to the host, in one copy.

    tokens, log_probs, tops = draw(logits, seqs)    # logits [B, vocab] on any device; seqs: `Running`
    tokens, log_probs = sample(logits, seqs)         # the same without alternatives
    tops = alternatives(logits, seqs)                # per row {id: log-prob} of its top_logprobs, or None

A request's logit bias and penalties are applied first (`phyai_ray.llm.logits.processed`); the
log-probs reported are the raw logits'. Greedy rows (temperature 0) take the argmax. A sampled row
keeps the tokens its `min_p`, `top_k` and `top_p` allow (`kept_mass`) and draws one of them by inverse CDF: with u in [0, 1) from the row's seed,
the token where the running sum of the kept masses passes u * their total.

The masses are whole numbers, floor(softmax(logits / temperature) * 2**40), summed in float64
(exact below 2**53), so which tokens a row keeps and draws does not depend on the order of the
additions: not on the batch beside it, the device, or the kernel (atomics included). u is a hash of (the sequence's seed, the index of the token
drawn), so a seeded sequence draws the same tokens whatever runs beside it, on every rank alike,
and a recomputed sequence (after a weight update) goes on with the draws it would have made.

No sort of the vocabulary: top_k needs the k-th largest probability (`topk`); top_p needs the
probability q* where the nucleus ends, found by a radix select over the bits of the float32
probabilities (they order like the values): three levels of 11, 10 and 10 bits, each a histogram
of the kept masses (`scatter_add_`), whose running sum from the top names the bucket that holds
q*, then the same within that bucket. Probabilities [.5, .3, .2] with top_p=0.7: the mass above
.3 is .5 < .7, the mass above .2 is .8 >= .7, so q* = .3 and {.5, .3} stay.
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

from phyai_ray.llm.logits import processed

FIXED = 2.0 ** 40  # masses are probabilities in units of 2**-40: whole numbers whose sums stay exact in float64
LEVELS = ((20, 11), (10, 10), (0, 10))  # (shift, width) of the float32 bits resolved per radix level
MASK64 = (1 << 64) - 1


def draw(logits: torch.Tensor, seqs: list[Any]) -> tuple[list[int], list[float], list[dict[int, float] | None] | None]:
    """Per row of `logits` [B, vocab]: its next token, that token's log-prob under the raw logits and,
    when any row asks (`top_logprobs`), its most likely tokens {id: log-prob} (None for rows that do not)."""
    x = logits.float()
    rows, vocab = x.shape
    if rows != len(seqs):
        raise ValueError(f"sampling: logits have {rows} rows but {len(seqs)} sequences were given; "
                         "pass one sequence per row")
    log_probs = x.log_softmax(-1)  # the raw logits' (vLLM's default), whatever the processors change
    x = processed(x, seqs)
    chosen = x.argmax(-1)
    drawn = [i for i, s in enumerate(seqs) if s.temperature > 0.0]
    if drawn:
        params = _params([seqs[i] for i in drawn], drawn, x.device)
        index = params[:, 4].long()
        knobs = {"largest_k": max(seqs[i].top_k for i in drawn), "nucleus": any(seqs[i].top_p < 1.0 for i in drawn),
                 "floor": any(getattr(seqs[i], "min_p", 0.0) > 0.0 for i in drawn)}
        chosen = chosen.index_copy(0, index, _draw_rows(x.index_select(0, index), params, **knobs))
    parts = [chosen.double(), log_probs.gather(1, chosen[:, None]).squeeze(1).double()]
    asked = [s.top_logprobs for s in seqs]
    wanted = [min(int(n or 0), vocab) for n in asked] if any(asked) else None
    k = max(wanted) if wanted else 0
    if k:
        values, ids = log_probs.topk(k, dim=-1)
        parts += [ids.double().flatten(), values.double().flatten()]
    host = torch.cat(parts).cpu().tolist()  # the one copy to the host
    tokens, lps = list(map(int, host[:rows])), host[rows:2 * rows]
    if not k:
        return tokens, lps, None
    ids, values = host[2 * rows:2 * rows + rows * k], host[2 * rows + rows * k:]
    tops = [{int(t): v for t, v in zip(ids[r * k:r * k + n], values[r * k:r * k + n])} if n else None
            for r, n in enumerate(wanted)]
    return tokens, lps, tops


def sample(logits: torch.Tensor, seqs: list[Any]) -> tuple[list[int], list[float]]:
    """The next token of every row of `logits` [B, vocab] and its log-prob under the raw logits."""
    tokens, log_probs, _ = draw(logits, [_NoTops(s) for s in seqs])
    return tokens, log_probs


def alternatives(logits: torch.Tensor, seqs: list[Any]) -> list[dict[int, float] | None] | None:
    """Per row, its `top_logprobs` most likely tokens {id: log-prob} under the raw logits; None when no row asks."""
    if not any(s.top_logprobs for s in seqs):
        return None
    return draw(logits, [_Greedy(s) for s in seqs])[2]


def kept_mass(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              largest_k: int | None = None, nucleus: bool | None = None, min_p: torch.Tensor | None = None,
              floor: bool = True) -> torch.Tensor:
    """[b, vocab] float32 whole numbers: each token's mass floor(softmax(x / temperature) * 2**40) where
    min_p, top_k and top_p keep it, else 0 (exact in float64 sums, whatever their order).

    min_p (vLLM's, transformers' `MinPLogitsWarper`) keeps the tokens at least min_p x the most
    likely one's probability (`floor`: whether any row has one). top_k keeps the tokens at least as likely as the k-th (ties kept; 0: all). top_p then keeps a
    token when the mass of the kept tokens strictly more likely than it is below top_p of the kept
    total (so a tie at the boundary stays whole); the most likely token always stays. `largest_k`
    (max of top_k) and `nucleus` (any top_p < 1), when the caller knows them, spare a wait for the device."""
    p = (x.float() / temperature.float()[:, None]).softmax(-1)  # float32: its bits order like its values
    mass = (p * FIXED).floor_()
    if min_p is not None and floor:
        mass.masked_fill_(p < min_p.float()[:, None] * p.amax(-1, keepdim=True), 0.0)
    k = min(int(top_k.max()) if largest_k is None else largest_k, p.shape[-1])
    if k:
        kth = p.topk(k, dim=-1).values.gather(1, (top_k.long() - 1).clamp(0, k - 1)[:, None])
        mass.masked_fill_(p < torch.where(top_k[:, None] > 0, kth, 0.0), 0.0)
    if bool((top_p < 1.0).any()) if nucleus is None else nucleus:
        mass64 = mass.double()
        total = mass64.sum(-1)
        # a token stays when the kept mass above it S < need; for whole numbers S, S < ceil(t) means S < t
        need = torch.where(top_p < 1.0, (top_p * total).ceil().clamp(min=1.0), total + 1.0)
        bits = p.view(torch.int32)
        mass.masked_fill_(bits < _nucleus_floor(bits, mass64, need)[:, None], 0.0)
    return mass


def _nucleus_floor(bits: torch.Tensor, mass: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """[b] int32: per row, the float32 bits of the least likely token whose strictly-more-likely mass
    is below `need` (the radix select of the module docstring; `bits` order like the probabilities).

    A level sorts the tokens whose higher bits equal the prefix found so far into 2**width buckets
    by their next bits (1 .. 2**width; the others into 0 and 2**width + 1, left out)."""
    rows = bits.shape[0]
    prefix = torch.zeros(rows, dtype=torch.int32, device=bits.device)
    for shift, width in LEVELS:
        relative = (bits >> shift) - (prefix << width)[:, None]
        bucket = relative.add_(1).clamp_(0, (1 << width) + 1).long()
        hist = torch.zeros(rows, (1 << width) + 2, dtype=mass.dtype, device=bits.device)
        hist = hist.scatter_add_(1, bucket, mass)[:, 1:-1]
        above = hist.flip(-1).cumsum(-1).flip(-1) - hist  # mass in the higher buckets (within prefix)
        found = ((hist > 0) & (above < need[:, None])).int().argmax(-1)  # the lowest such bucket
        need = need - above.gather(1, found[:, None]).squeeze(1)
        prefix = (prefix << width) | found.int()
    return prefix


def _draw_rows(x: torch.Tensor, params: torch.Tensor, **knobs: Any) -> torch.Tensor:
    """[b] token ids drawn from rows `x` [b, vocab] by inverse CDF over their kept masses."""
    mass = kept_mass(x, params[:, 0].float(), params[:, 2], params[:, 1], min_p=params[:, 5], **knobs)
    running = mass.cumsum(-1, dtype=torch.float64)
    total = running[:, -1]
    target = torch.minimum((params[:, 3] * total).floor(), total - 1.0)
    # NaN logits (a broken model) would point past the end; the clamp keeps the id a valid token
    return torch.searchsorted(running, target[:, None], right=True).squeeze(1).clamp_(max=x.shape[-1] - 1)


def _params(seqs: list[Any], rows: list[int], device: Any) -> torch.Tensor:
    """[b, 6] float64 on `device` in one copy: temperature, top_p, top_k, u, row index, min_p."""
    values = [v for s, r in zip(seqs, rows)
              for v in (s.temperature, s.top_p, float(s.top_k), uniform(_seed(s), len(s.tokens)), float(r),
                        float(getattr(s, "min_p", 0.0)))]
    return torch.frombuffer(array("d", values), dtype=torch.float64).view(-1, 6).to(device)


def _seed(seq: Any) -> int:
    return int(seq.generator.initial_seed())


def uniform(seed: int, index: int) -> float:
    """A number in [0, 1) that depends only on (seed, index): splitmix64 of both, 53 bits."""
    return (_mix(_mix(seed & MASK64) ^ index) >> 11) * 2.0 ** -53


def _mix(z: int) -> int:
    """splitmix64's finaliser: a 64-bit to 64-bit hash whose every output bit depends on every input bit."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class _NoTops:
    """`seq` with no alternatives asked (sample's view)."""

    def __init__(self, seq: Any) -> None:
        self.seq, self.top_logprobs = seq, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.seq, name)


class _Greedy(_NoTops):
    """`seq` drawn greedily (alternatives' view: the draw itself is not wanted)."""

    def __init__(self, seq: Any) -> None:
        super().__init__(seq)
        self.top_logprobs, self.temperature = seq.top_logprobs, 0.0


def filtered_weights(logits: torch.Tensor, seqs: list[Any]) -> torch.Tensor:
    """Row i's sampling weights over the vocabulary (unnormalised) by sorting: the dense reference of
    `kept_mass` for tests, not used to sample. Ties at the top_p boundary follow the sort order here."""
    vocab = logits.shape[-1]
    temperature = torch.tensor([s.temperature for s in seqs])[:, None]
    top_p = torch.tensor([s.top_p for s in seqs])[:, None]
    top_k = torch.tensor([min(s.top_k, vocab) if s.top_k else vocab for s in seqs])[:, None]
    ordered, index = (logits / temperature).sort(-1, descending=True)
    p = ordered.softmax(-1) * (ordered >= ordered.gather(1, top_k - 1))
    before = p.cumsum(-1) - p  # mass of the kept tokens ahead of each
    p = p * ((before < top_p * p.sum(-1, keepdim=True)) | (top_p >= 1.0))
    return torch.empty_like(p).scatter_(-1, index, p)
