"""Sampling on the device (`phyai_ray.llm.sampler`): batch invariance, the top_k / top_p rule, one host copy.

Run: .venv/bin/pytest tests/test_sampler.py -q

A seeded row draws the same token alone as in a batch of 8 rows of other seeds, temperatures and
filters; greedy rows are the argmax; the tokens a row keeps are those of the dense, sorting
reference (`filtered_weights`), and draws over many seeds follow its weights. No sort of the
vocabulary runs, and one copy of 2B (+ 2Bk with top log-probs) numbers crosses to the host.
"""

from __future__ import annotations

import pytest
import torch

from phyai_ray.llm import sampler
from phyai_ray.llm.sampler import alternatives, draw, filtered_weights, kept_mass, sample, uniform
from phyai_ray.llm.sequence import Running
from tests.tolerances import reordered

VOCAB = 500
MIXED = [dict(temperature=1.0, top_k=0, top_p=0.9), dict(temperature=0.0, top_k=0, top_p=1.0),
         dict(temperature=0.7, top_k=20, top_p=1.0), dict(temperature=1.3, top_k=5, top_p=0.5),
         dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.2, top_k=0, top_p=0.3),
         dict(temperature=2.0, top_k=100, top_p=0.95), dict(temperature=1.0, top_k=1, top_p=1.0)]


def running(i: int, seed: int, vocab: int = VOCAB, tokens: int = 0, top_logprobs: int = 0, **knobs) -> Running:
    payload = {"prompt": [1], "max_tokens": 64, "seed": seed, "stop_token_ids": [], "top_logprobs": top_logprobs,
               **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, **knobs}}
    seq = Running.from_payload(i, payload, 128, vocab)
    seq.tokens = [0] * tokens  # the index of the token drawn next
    return seq


def logits(rows: int, vocab: int = VOCAB, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_rows_are_the_argmax_with_the_log_softmax_of_the_raw_logits() -> None:
    x = logits(6)
    tokens, lps = sample(x, [running(i, i, temperature=0.0) for i in range(6)])
    assert tokens == x.argmax(-1).tolist()
    want = x.log_softmax(-1).gather(1, x.argmax(-1)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), want.double(),
                               **reordered(torch.float32, terms=VOCAB, like=want))  # log-softmax over the vocabulary


@pytest.mark.parametrize("step", [0, 1, 7])
def test_a_seeded_row_draws_the_same_alone_as_in_a_batch_of_eight(step: int) -> None:
    x = logits(8, seed=step)
    seqs = [running(i, 1000 + 17 * i, tokens=step + i, top_logprobs=i % 3, **knobs) for i, knobs in enumerate(MIXED)]
    together = draw(x, seqs)
    for i, seq in enumerate(seqs):
        alone = draw(x[i:i + 1].clone(), [seq])
        assert (alone[0][0], alone[1][0]) == (together[0][i], together[1][i]), (i, MIXED[i])
        assert (alone[2][0] if alone[2] else None) == together[2][i]
    assert draw(x, seqs) == together  # run to run
    assert together[0][1] == int(x[1].argmax())  # the greedy row


def test_the_draw_depends_on_the_seed_and_the_token_index_only() -> None:
    x = logits(1, scale=0.5).expand(64, VOCAB).contiguous()
    by_seed = sample(x, [running(i, seed=i) for i in range(64)])[0]
    by_index = sample(x, [running(i, seed=5, tokens=i) for i in range(64)])[0]
    assert len(set(by_seed)) > 20 and len(set(by_index)) > 20
    assert sample(x[:1], [running(0, seed=5, tokens=9)])[0] == [by_index[9]]
    assert all(0.0 <= uniform(s, i) < 1.0 for s in (0, 1, 2 ** 63 - 1) for i in range(50))


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_the_kept_tokens_are_those_of_the_sorting_reference(scale: float) -> None:
    gen = torch.Generator().manual_seed(1)
    for trial in range(40):
        knobs = [dict(temperature=float(torch.rand(1, generator=gen)) * 2 + 0.1,
                      top_k=int(torch.randint(0, 60, (1,), generator=gen)) * (trial % 2),
                      top_p=float(torch.rand(1, generator=gen)) * 0.98 + 0.01) for _ in range(4)]
        x = logits(4, vocab=200, scale=scale, seed=trial)
        seqs = [running(i, i, vocab=200, **k) for i, k in enumerate(knobs)]
        mass = kept_mass(x, *(torch.tensor([k[f] for k in knobs], dtype=torch.float64)
                              for f in ("temperature", "top_k", "top_p")))
        assert torch.equal(mass > 0, filtered_weights(x, seqs) > 0), (trial, knobs)


def test_draws_over_many_seeds_follow_the_kept_weights() -> None:
    x = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -9.0]])
    seqs = [running(i, seed=i, vocab=8) for i in range(40_000)]
    for knobs in (dict(temperature=1.0), dict(temperature=0.8, top_p=0.85), dict(temperature=1.5, top_k=3)):
        for seq in seqs:
            seq.temperature, seq.top_k, seq.top_p = knobs["temperature"], knobs.get("top_k", 0), knobs.get("top_p", 1.0)
        drawn = torch.tensor(draw(x.expand(len(seqs), 8).contiguous(), seqs)[0])
        seen = torch.bincount(drawn, minlength=8).double() / len(seqs)
        weights = filtered_weights(x, seqs[:1])[0].double()
        want = weights / weights.sum()
        assert (seen - want).abs().max() < 0.012, (knobs, seen, want)
        assert seen[want == 0].sum() == 0  # a filtered token is never drawn


def test_a_tie_at_the_top_p_boundary_stays_whole() -> None:
    x = torch.tensor([[3.0, 1.0, 1.0, 1.0, -2.0]])
    p = x.softmax(-1)[0]
    top_p = float(p[0] + p[1] / 2)  # the boundary falls inside the tie
    mass = kept_mass(x, torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([top_p], dtype=torch.float64))
    assert (mass[0] > 0).tolist() == [True, True, True, True, False]
    top_k = kept_mass(x, torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([1.0], dtype=torch.float64))
    assert (top_k[0] > 0).tolist() == [True, True, True, True, False]  # top_k=2 keeps the tie with the 2nd


def test_no_sort_of_the_vocabulary_and_one_copy_to_the_host(monkeypatch) -> None:
    copies = []
    real_cpu = torch.Tensor.cpu

    def counted(self, *args, **kwargs):
        copies.append(self.numel())
        return real_cpu(self, *args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("sampling sorted the vocabulary")

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    for name in ("sort", "argsort", "msort"):
        monkeypatch.setattr(torch, name, refused)
        monkeypatch.setattr(torch.Tensor, name, refused)
    seqs = [running(i, i, top_logprobs=3, **knobs) for i, knobs in enumerate(MIXED)]
    tokens, lps, tops = draw(logits(8), seqs)
    assert copies == [2 * 8 + 2 * 8 * 3] and len(tokens) == len(lps) == len(tops) == 8
    assert all(len(t) == 3 and max(t.values()) <= 0 for t in tops)


def test_sample_and_alternatives_agree_with_draw_and_bad_shapes_are_refused() -> None:
    x = logits(8)
    seqs = [running(i, 3 * i, top_logprobs=(2 if i % 2 else 0), **knobs) for i, knobs in enumerate(MIXED)]
    tokens, lps, tops = draw(x, seqs)
    assert sample(x, seqs) == (tokens, lps) and alternatives(x, seqs) == tops
    assert [t is None for t in tops] == [i % 2 == 0 for i in range(8)]
    assert alternatives(x, [running(i, i) for i in range(8)]) is None
    with pytest.raises(ValueError, match="8 rows but 2 sequences"):
        draw(x, seqs[:2])


def test_the_nucleus_floor_is_the_least_likely_kept_probability() -> None:
    x = logits(3, vocab=1000, scale=2.0)
    p = x.softmax(-1)
    mass = (p * sampler.FIXED).floor().double()
    need = (0.6 * mass.sum(-1)).ceil()
    floor = sampler._nucleus_floor(p.view(torch.int32), mass, need)
    for row in range(3):
        kept = p[row][p[row].view(torch.int32) >= floor[row]]
        assert mass[row][p[row] > kept.min()].sum() < need[row] <= mass[row][p[row] >= kept.min()].sum()
