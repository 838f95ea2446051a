"""Sampling seeds of the token plugins: unset means a fresh random seed, a given seed is deterministic.

Run: .venv/bin/pytest tests/test_llm_seeds.py -q

Before, `Sampling.seed` defaulted to 0, so n unseeded sampled requests of one prompt returned n
equal completions (every GRPO advantage 0). Now the dispatcher draws one seed per unseeded request
(`validate_request`, before any rank sees it) and each sequence of it gets its own (`sequence_seed`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phyai_ray import Engine, EngineArgs, EngineConfig
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.llm.sampling import Sampling, sequence_seed
from phyai_ray.validation import checked

SAMPLED = {"max_tokens": 12, "temperature": 1.0}


def completions(eng: Engine, request: dict, times: int) -> list[tuple[int, ...]]:
    futures = [eng.submit(dict(request)) for _ in range(times)]
    return [tuple(out.token_ids) for f in futures for out in f.result(timeout=120)]


def test_an_unset_seed_is_drawn_once_and_a_given_one_kept() -> None:
    assert Sampling().seed is None
    fixed = Sampling(seed=7)
    assert fixed.seeded() is fixed
    drawn = {Sampling().seeded().seed for _ in range(8)}
    assert len(drawn) > 1 and all(isinstance(s, int) and s >= 0 for s in drawn)
    assert sequence_seed(7, 1) == sequence_seed(7, 1) != sequence_seed(7, 2)
    assert sequence_seed(None, 0) != sequence_seed(None, 0)


def test_reference_lm_unseeded_requests_differ_and_seeded_ones_repeat() -> None:
    with Engine(EngineArgs(plugin="reference_lm", plugin_args={"seed": 0},
                           config=EngineConfig(device=DeviceConfig(target="cpu")))) as eng:
        request = {"prompts": [[1, 2, 3]], **SAMPLED}
        validated = checked(eng.entry, request)
        assert isinstance(validated["seed"], int) and "seed" not in request  # drawn in the dispatcher
        assert len(set(completions(eng, request, 6))) > 1
        assert len(set(completions(eng, {**request, "seed": 5}, 4))) == 1
        n_copies = eng.step({"prompts": [[1, 2, 3]] * 4, **SAMPLED})  # n > 1: each sequence its own seed
        assert len({tuple(o.token_ids) for o in n_copies}) > 1


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from tests.hf_checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "llama")


def test_hf_causal_lm_unseeded_requests_differ_and_seeded_ones_repeat(llama) -> None:
    with Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(llama)},
                           config=EngineConfig(device=DeviceConfig(target="cpu")))) as eng:
        request = {"prompts": [[1, 50, 60, 70]], **SAMPLED}
        first, second = checked(eng.entry, request), checked(eng.entry, request)
        assert first.request.seed is not None and first.request.seed != second.request.seed
        assert len(set(completions(eng, request, 6))) > 1
        assert len(set(completions(eng, {**request, "seed": 5}, 4))) == 1
        n_copies = eng.step({"prompts": [[1, 50, 60, 70]] * 4, **SAMPLED})
        assert len({tuple(o.token_ids) for o in n_copies}) > 1
        assert eng.step({**request, "temperature": 0.0})[0].token_ids == \
            eng.step({**request, "temperature": 0.0})[0].token_ids  # greedy is unaffected
