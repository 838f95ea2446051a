"""What a request changes in the logits before a token is chosen, as vLLM applies it.

    x = processed(logits, seqs)      # [B, vocab] float32; rows whose sequence changes nothing stay as they are

Per row, in vLLM's order (its v1 sampler), before temperature, top-k, top-p and min_p (`sampler`):

1. `logit_bias` {id: b}: b is added to that id's logit (OpenAI's -100..100: +100 all but forces it).
2. `repetition_penalty` r: every id of the prompt or the output so far has its logit divided by r
   when positive, multiplied by r otherwise (r > 1 discourages, as transformers'
   `RepetitionPenaltyLogitsProcessor` over prompt + output does).
3. `frequency_penalty` f and `presence_penalty` p: logit -= f x (times the id was generated) + p x
   (1 if it was generated at all); the output only, never the prompt (OpenAI's definition).

Greedy rows take the argmax of the processed row, so bias and penalties act on them too; min_p is
applied with temperature in `sampler.kept_mass` (it never changes the argmax). The log-probs a
token reports are the raw logits' (vLLM's default `raw_logprobs`), not the processed ones.
"""

from __future__ import annotations

from typing import Any

import torch

from phyai_ray.llm.sequence import tensor_of


def changes(seq: Any) -> bool:
    """Whether `seq` asks for any of the processors above (a `Running` knows: its `processors`)."""
    known = getattr(seq, "processors", None)
    if known is not None:
        return known
    return bool(getattr(seq, "logit_bias", None)) or getattr(seq, "repetition_penalty", 1.0) != 1.0 or \
        getattr(seq, "frequency_penalty", 0.0) != 0.0 or getattr(seq, "presence_penalty", 0.0) != 0.0


def processed(logits: torch.Tensor, seqs: list[Any]) -> torch.Tensor:
    """`logits` [B, vocab] with each row's processors applied (a copy when any row has one)."""
    rows = [i for i, s in enumerate(seqs) if changes(s)]
    if not rows:
        return logits
    x = logits.clone()
    for i in rows:
        process_row(x[i], seqs[i])
    return x


def process_row(row: torch.Tensor, seq: Any) -> None:
    """Apply `seq`'s bias and penalties to its logits `row` [vocab], in place."""
    device = row.device
    if seq.logit_bias:
        ids = tensor_of("q", list(seq.logit_bias)).to(device)
        row.index_add_(0, ids, tensor_of("f", list(seq.logit_bias.values())).to(device, row.dtype))
    if seq.repetition_penalty != 1.0:
        seen = tensor_of("q", seq.prompt + seq.tokens).to(device).unique()
        values = row[seen]
        row[seen] = torch.where(values > 0, values / seq.repetition_penalty, values * seq.repetition_penalty)
    if seq.tokens and (seq.frequency_penalty or seq.presence_penalty):
        counts = torch.bincount(tensor_of("q", seq.tokens).to(device), minlength=row.shape[0]).to(row.dtype)
        row -= seq.frequency_penalty * counts + seq.presence_penalty * (counts > 0).to(row.dtype)
