"""One weight version across a fleet: three inline `hf_causal_lm` engines under steady requests.

`WeightSender.update([a, b, c], params, version=v)` stages the weights on every rank while the fleet
serves v - 1, verifies each rank's digest of what it received, then switches every replica together:
every result finished before the switch began carries v - 1 only, every result finished after it
carries v, and the outputs are transformers' under the new weights. A tensor corrupted on its way
to one engine's rank rolls all three back (they keep serving v - 1) and the error names that rank.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from phyai_ray import WeightSender
from phyai_ray.rl.fleet import FleetUpdateError
from tests.hf_checkpoints import load_reference, write_checkpoint
from tests.test_hf_causal_lm import PROMPTS, TOKENS, assert_matches, perturbed, reference
from tests.test_hf_paged import engine

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("fleet") / "qwen2", "qwen2", tied=True)
    engines = [engine(folder) for _ in range(3)]
    try:
        yield engines, load_reference(folder)
    finally:
        for e in engines:
            e.close()


class Steady:
    """Requests sent to every engine in turn until stopped: (finished at, the versions of its tokens). "Finished
    at" is when its outcome was set (`EngineFuture.finished`), not when this thread read it: a request that
    ended before the switch but was read after the others' waits would otherwise look like one after it."""

    def __init__(self, engines: list) -> None:
        self.engines, self.results, self.stop = engines, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            futures = [e.submit({"prompts": [PROMPTS[i % 3]], "max_tokens": 6}) for e in self.engines]
            for f in futures:
                [out] = f.result(timeout=60)
                self.results.append((f.finished, set(out.weight_versions)))
            i += 1

    def finish(self) -> list:
        self.stop.set()
        self.thread.join(timeout=60)
        return self.results


def test_three_engines_switch_together_under_steady_requests(fleet) -> None:
    engines, model = fleet
    sender = WeightSender()
    sender.update(engines, model.named_parameters(), version=1)
    steady = Steady(engines)
    time.sleep(0.3)
    params = perturbed(model, seed=5)
    report = sender.update(engines, params.items(), version=2)
    time.sleep(0.3)
    results = steady.finish()
    before = [v for t, v in results if t < report.paused_at]
    after = [v for t, v in results if t > report.switched_at]
    assert before and after and all(v == {1} for v in before) and all(v == {2} for v in after)
    assert report.pause_s < report.stage_s + 5 and report.verify_s > 0
    want = reference(model, PROMPTS[0], TOKENS)
    for e in engines:
        assert_matches(e.step({"prompts": [PROMPTS[0]], "max_tokens": TOKENS})[0], want)


class Corrupting:
    """An engine whose staged buckets arrive with one byte changed (a transfer gone wrong)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collective_rpc(self, method: str, *args, **kwargs):
        if method == "stage_weights":
            version, buckets = args
            (bucket, flat), rest = buckets[0], buckets[1:]
            bad = flat.clone()
            bad[3] += 1.0
            args = (version, [(bucket, bad), *rest])
        return self.engine.collective_rpc(method, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def test_a_corrupted_tensor_on_one_rank_rolls_every_engine_back_and_names_it(fleet) -> None:
    engines, model = fleet
    sender = WeightSender()
    sender.update(engines, model.named_parameters(), version=3)
    want = engines[0].step({"prompts": [PROMPTS[1]], "max_tokens": TOKENS})[0].token_ids
    with torch.no_grad():
        changed = [(n, p + 1.0) for n, p in model.named_parameters()]
    with pytest.raises(FleetUpdateError, match=r"rolled back on every target .*target 1 replica 0 rank 0: digest") \
            as info:
        sender.update([engines[0], Corrupting(engines[1]), engines[2]], changed, version=4)
    assert [d[:3] for d in info.value.differed] == [(1, 0, 0)]
    for e in engines:
        out = e.step({"prompts": [PROMPTS[1]], "max_tokens": TOKENS})[0]
        assert out.weight_version == 3 and out.token_ids == want
    assert all(r == [[0]] for r in (e.collective_rpc("discard_staged", all_ranks=True) for e in engines))
