"""Logit bias, penalties and min_p against transformers' logits processors (vLLM's definitions).

Rows of random logits with a prompt and an output so far: `processed` equals transformers'
`SequenceBiasLogitsProcessor` (one-token sequences) and `RepetitionPenaltyLogitsProcessor` over prompt +
output; frequency / presence penalties equal a `LogitsProcessor` written to OpenAI's formula over the
output only; min_p keeps exactly what `MinPLogitsWarper` leaves finite. End to end, greedy
`hf_causal_lm` with a penalty or a bias generates transformers' `generate` tokens with the same
processors, and reports the raw logits' log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from phyai_ray.llm.logits import processed
from phyai_ray.llm.sampler import kept_mass

transformers = pytest.importorskip("transformers")
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,  # noqa: E402
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper)
from tests.tolerances import against

VOCAB = 50


@dataclass
class Seq:
    prompt: list[int]
    tokens: list[int]
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency / presence penalties over the tokens after `prompt_len` (the output)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, input_ids[:, self.prompt_len:], torch.ones_like(input_ids[:, self.prompt_len:],
                                                                               dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def transformers_row(seq: Seq, row: torch.Tensor) -> torch.Tensor:
    ids = torch.tensor([seq.prompt + seq.tokens])
    chain = []
    if seq.logit_bias:
        chain.append(SequenceBiasLogitsProcessor({(k,): v for k, v in seq.logit_bias.items()}))
    if seq.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(seq.repetition_penalty))
    if seq.frequency_penalty or seq.presence_penalty:
        chain.append(OpenAIPenalties(len(seq.prompt), seq.frequency_penalty, seq.presence_penalty))
    return LogitsProcessorList(chain)(ids, row[None].clone())[0]


def test_bias_and_penalties_equal_transformers_processors() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=g) * 3
    prompt, out = [3, 4, 4, 9, 17], [4, 9, 9, 9, 22, 30]
    seqs = [Seq(prompt, out, logit_bias={14: 100.0, 3: -5.5}), Seq(prompt, out, repetition_penalty=1.3),
            Seq(prompt, out, frequency_penalty=0.7, presence_penalty=-0.4),
            Seq(prompt, out, logit_bias={1: 2.0}, repetition_penalty=0.8, frequency_penalty=2.0, presence_penalty=1.0),
            Seq(prompt, out)]
    got = processed(logits, seqs)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[i], transformers_row(seq, logits[i]))
    assert torch.equal(got[4], logits[4]) and not torch.equal(got[0], logits[0])


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.2, 0.7), (0.5, 1.5)])
def test_min_p_keeps_what_transformers_min_p_warper_keeps(min_p, temperature) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    mass = kept_mass(logits, torch.full((4,), temperature), torch.zeros(4), torch.ones(4, dtype=torch.float64),
                     min_p=torch.full((4,), min_p))
    warped = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    assert torch.equal(mass > 0, torch.isfinite(warped))
    assert (mass > 0).sum() < mass.numel()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.hf_checkpoints import load_reference, write_checkpoint

    folder = write_checkpoint(tmp_path_factory.mktemp("logits") / "llama", "llama")
    return folder, load_reference(folder)


PROMPT = [1, 17, 23, 17, 42, 5, 9]


def generated(model, max_tokens: int, processors: list) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
                             logits_processor=LogitsProcessorList(processors))
    tokens = out.sequences[0, len(PROMPT):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]


def test_greedy_generation_with_penalties_and_bias_equals_transformers(llama) -> None:
    from phyai_ray import Engine, EngineArgs, EngineConfig
    from phyai_ray.config.engine import DeviceConfig

    folder, model = llama
    cases = [({"repetition_penalty": 1.5}, [RepetitionPenaltyLogitsProcessor(1.5)]),
             ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, [OpenAIPenalties(len(PROMPT), 1.5, 0.5)]),
             ({"logit_bias": {14: 100.0}}, [SequenceBiasLogitsProcessor({(14,): 100.0})])]
    args = EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    with Engine(args) as eng:
        plain = eng.step({"prompts": [PROMPT], "max_tokens": 12, "ignore_eos": True})[0]
        futures = [eng.submit({"prompts": [PROMPT], "max_tokens": 12, "ignore_eos": True, **knobs})
                   for knobs, _ in cases]
        outs = [f.result(timeout=120)[0] for f in futures]
    for out, (knobs, processors) in zip(outs, cases):
        tokens, log_probs = generated(model, 12, processors)
        assert out.token_ids == tokens and out.token_ids != plain.token_ids, knobs
        torch.testing.assert_close(torch.tensor(out.log_probs), torch.tensor(log_probs), **against("transformers", "log_probs"))
    assert outs[2].token_ids == [14] * 12
