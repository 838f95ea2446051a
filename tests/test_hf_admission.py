"""One admission seam for `hf_causal_lm`: the engine's loop admits only what the rank's KV cache can start.

Run: .venv/bin/pytest tests/test_hf_admission.py -q

The rank reports its KV cache after every iteration (`KVReport`: free blocks less what its own
sequences still need, the tokens they take next); `KVBlocks` admits the waiting head only when its
prompt's blocks and tokens fit. Under a pool that holds a few sequences, many requests never wait
on the rank (`prefix_cache_stats()["held"]`, admitted sequences left unstarted after an iteration,
stays 0, where the loop's token budget alone leaves them there), and greedy results still equal
transformers' `generate`. A request with a short deadline that cannot start while the pool is full
is answered DeadlineMissedError from the engine's queue (never started; its queue_ms is its wait),
and requests behind a full pool start only once it frees (their queue_ms covers the wait).
One token budget: the deployment's BatchingConfig value reaches the rank, and a plugin_args value
that disagrees with it is refused at start. Pure tables of the policy and the report close the file.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from phyai_ray import DeploymentConfig, Engine, EngineArgs, EngineConfig
from phyai_ray.config.batching import BatchingConfig
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.errors import DeadlineMissedError
from phyai_ray.llm.blocks import BlockPool
from phyai_ray.llm.paged import PagedSequences
from phyai_ray.models.hf_causal_lm.entry import HFCausalLMEntry
from phyai_ray.plugins.admission import KVBlocks, TokenBudget
from phyai_ray.plugins.iteration import Candidate, KVReport
from tests.hf_checkpoints import load_reference, write_checkpoint
from tests.test_hf_causal_lm import PROMPTS, assert_matches, reference

pytest.importorskip("transformers")
TOKENS = 10
PER_BLOCK_4 = 2 * 2 * 2 * 4 * 16 * 4  # keys and values x layers x kv heads x block of 4 x head_dim x fp32
PER_BLOCK_16 = 4 * PER_BLOCK_4


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("admission") / "llama", "llama")


@pytest.fixture(scope="module")
def model(llama):
    return load_reference(llama)


def engine(folder: Path, batching: BatchingConfig | None = None, **plugin_args) -> Engine:
    return Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder), **plugin_args},
                             config=EngineConfig(device=DeviceConfig(target="cpu"))),
                  DeploymentConfig(batching=batching or BatchingConfig()))


def stats(eng: Engine) -> dict:
    [reply] = eng.collective_rpc("prefix_cache_stats")
    return reply


def many_over_a_small_pool(folder: Path) -> tuple[list, dict]:
    """12 requests over 16 blocks of 4 tokens (one sequence of max_model_len=64; each needs up to 6)."""
    prompts = [PROMPTS[i % 3] for i in range(12)]
    with engine(folder, block_size=4, kv_cache_bytes=16 * PER_BLOCK_4, max_model_len=64) as eng:
        futures = [eng.submit({"prompts": [p], "max_tokens": TOKENS}) for p in prompts]
        outs = [f.result(timeout=120)[0] for f in futures]
        return list(zip(prompts, outs, futures)), stats(eng)


def test_many_requests_over_a_pool_of_a_few_sequences_never_wait_on_the_rank(llama, model) -> None:
    runs, counted = many_over_a_small_pool(llama)
    for prompt, out, future in runs:
        assert_matches(out, reference(model, prompt, TOKENS))
        assert future.started is not None
    assert counted["held"] == 0 and counted["waiting"] == 0 and counted["free_blocks"] == 16
    assert counted["preemptions"] > 0  # decodes still outgrow the pool: preempted ones are rebuilt on the rank
    queued = sorted(f.timing()["queue_ms"] for _, _, f in runs)
    assert queued[-1] > 10 * max(queued[0], 0.1)  # the last ones waited in the engine's queue for blocks


def ids(n: int, seed: int) -> list[int]:
    return [1] + [(seed + 13 * i) % 280 + 5 for i in range(n - 1)]


def test_short_deadlines_behind_a_full_pool_fail_in_the_engine_queue_with_true_timing(llama, model) -> None:
    # 16 blocks of 16: one sequence of 256 tokens. A 200-token prompt decoding 56 tokens fills it; a
    # 60-token prompt needs 4 blocks, so nothing else starts until it ends.
    long_prompt, short = ids(200, 3), [ids(60, 7 + k) for k in range(4)]
    long_request = {"prompts": [long_prompt], "max_tokens": 56, "ignore_eos": True}
    with engine(llama, kv_cache_bytes=16 * PER_BLOCK_16) as eng:
        alone = []
        for _ in range(2):  # the long request's whole run (the faster of two), to set the deadlines by
            began = time.monotonic()
            eng.submit(long_request).result(timeout=120)
            alone.append(time.monotonic() - began)
        deadline_s = min(alone) / 4
        long_future = eng.submit(long_request)
        limit = time.monotonic() + 60
        while not stats(eng)["running"]:  # its prefill has run: the pool is full for its decodes
            assert time.monotonic() < limit and not long_future.done()
        late = [eng.submit({"prompts": [p], "max_tokens": 1}, deadline_s=deadline_s) for p in short[:2]]
        behind = [eng.submit({"prompts": [p], "max_tokens": 4}) for p in short[2:]]
        for future in late:
            with pytest.raises(DeadlineMissedError):
                future.result(timeout=120)
        outs = [f.result(timeout=120)[0] for f in behind]
        long_future.result(timeout=120)
        counted = stats(eng)
    for future in late:  # never started; its whole wait was in the engine's queue, past its deadline
        timing = future.timing()
        assert future.started is None and timing["deadline_met"] is False
        assert timing["queue_ms"] >= 0.5 * timing["deadline_ms"]  # answered at its deadline, or a pace before it
    for future, out, prompt in zip(behind, outs, short[2:]):  # started once the long one ended and freed its blocks
        assert future.started >= long_future.finished
        assert future.timing()["queue_ms"] >= (long_future.finished - future.submitted) * 1e3
        assert_matches(out, reference(model, prompt, 4))
    assert counted["held"] == 0


def test_one_token_budget_reaches_the_rank_and_a_disagreeing_plugin_arg_is_refused(llama, model) -> None:
    with engine(llama, BatchingConfig(max_num_batched_tokens=4)) as eng:
        [out] = eng.step({"prompts": [PROMPTS[2]], "max_tokens": TOKENS})  # 11 tokens: chunks of 4
        assert stats(eng)["token_budget"] == 4
    assert_matches(out, reference(model, PROMPTS[2], TOKENS))
    with engine(llama, max_num_batched_tokens=8) as eng:  # the deployment keeps its default: plugin_args' value
        eng.step({"prompts": [PROMPTS[0]], "max_tokens": 2})
        assert stats(eng)["token_budget"] == 8
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=8 and the deployment's BatchingConfig\."
                                         r"max_num_batched_tokens=16 disagree"):
        engine(llama, BatchingConfig(max_num_batched_tokens=16), max_num_batched_tokens=8)


def c(cost: int, generated: int = 0, rebuild: bool = False) -> Candidate:
    return Candidate(cost=cost, generated=generated, rebuild=rebuild)


def joined(policy: KVBlocks, running: list[Candidate], waiting: list[Candidate]) -> int:
    policy.begin(running)
    count = 0
    for candidate in waiting:
        if not policy.admit(candidate):
            break
        count += 1
    return count


TABLE = [
    # report (free blocks, block size, busy tokens, budget), running, waiting, how many join
    ("the docstring's example", KVReport(10, 16, 4, 64), [c(4)] * 4, [c(40), c(40), c(8)], 1),
    ("blocks run out before tokens", KVReport(5, 16, 2, 4096), [c(4)] * 2, [c(48), c(33), c(1)], 1),
    ("a prompt part way fills the budget", KVReport(50, 16, 64, 64), [c(300)], [c(1)], 0),
    ("nothing runs: the head starts alone", KVReport(0, 16, 0, 64), [], [c(200), c(1)], 1),
    ("a rebuild in the plan: nothing joins", KVReport(50, 16, 2, 4096), [c(4, 3, rebuild=True), c(4)], [c(1)], 0),
    ("no report yet: only when nothing runs", None, [c(4)], [c(1)], 0),
]


@pytest.mark.parametrize("name, report, running, waiting, want", TABLE, ids=[row[0] for row in TABLE])
def test_kv_blocks_admits_what_the_report_holds(name, report, running, waiting, want) -> None:
    policy = KVBlocks(TokenBudget(256, 4096))
    if report is not None:
        policy.report(report)
    assert joined(policy, running, waiting) == want


def test_admitted_since_the_report_counts_until_the_next_report() -> None:
    policy = KVBlocks(TokenBudget(256, 4096))
    policy.report(KVReport(free_blocks=4, block_size=16, busy_tokens=1, token_budget=4096))
    assert joined(policy, [c(4)], [c(32), c(32), c(1)]) == 2  # 2 + 2 blocks
    assert joined(policy, [c(4)] * 3, [c(1)]) == 0  # no report since: the 4 blocks are still taken
    policy.report(KVReport(free_blocks=1, block_size=16, busy_tokens=3, token_budget=4096))
    assert joined(policy, [c(4)] * 3, [c(1)]) == 1


def test_the_report_reserves_what_running_and_preempted_sequences_need() -> None:
    pool = BlockPool(num_blocks=8, block_size=4, layers=1, kv_heads=1, head_dim=2, to={"dtype": torch.float32})
    paged = PagedSequences(pool, max_seq=32, vocab=64, token_budget=4)
    payload = {"max_tokens": 4, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0, "stop_token_ids": []}
    paged.admit(1, {**payload, "prompt": list(range(1, 11))})  # 10 tokens: 3 blocks, chunks of 4
    paged.finish(paged.schedule(), [], [])  # its first chunk: 1 block taken, 6 more tokens pending (2 blocks more)
    assert paged.capacity() == KVReport(free_blocks=8 - 1 - 2, block_size=4, busy_tokens=6, token_budget=4)
    paged.recompute(1)  # back to waiting, its whole history to rebuild: 3 blocks reserved
    assert paged.capacity() == KVReport(free_blocks=8 - 3, block_size=4, busy_tokens=10, token_budget=4)
    assert paged.held == 0
    paged.drop(1)
    paged.budget = 32
    paged.admit(2, {**payload, "prompt": list(range(1, 31)), "max_tokens": 2})  # 30 tokens: all 8 blocks at once
    paged.finish(paged.schedule(), [40], [0.0])
    paged.admit(3, {**payload, "prompt": [1, 2]})  # admitted past the report: no free block, it waits unstarted
    paged.schedule()
    assert paged.held == 1 and paged.capacity().free_blocks == 0
