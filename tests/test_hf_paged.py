"""`hf_causal_lm` on its paged KV cache against transformers: chunked, cached, under a tight budget, TP=2.

Run: .venv/bin/pytest tests/test_hf_paged.py -q        (the TP=2 test under the Ray lock:
     flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_hf_paged.py -q)

Greedy tokens equal transformers' `generate` and log-probs its log_softmax to 1e-4 (fp32), with
prefix caching on and off, for prompts longer than one iteration's token budget (prefilled in
chunks) batched with short ones; under a KV budget small enough that sequences wait for blocks
and running ones are preempted (and recomputed); eight requests of one 64-token prompt reuse its
cached blocks (counted by `prefix_cache_stats`) with the tokens of a run without caching; after a
weight update no block computed under the old weights is reused. The same at TP=2 on Ray.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, Engine, EngineArgs,
                       EngineConfig, ParallelConfig, WeightSender, WorkerSupervisorConfig)
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.models.hf_causal_lm import Architecture, HFCausalLMConfig
from tests.hf_checkpoints import load_reference, write_checkpoint
from tests.test_hf_causal_lm import PROMPTS, assert_matches, perturbed, reference
from tests.tolerances import against

pytest.importorskip("transformers")
TOKENS = 10
LONG = [1] + [(37 * i) % 300 + 5 for i in range(40)]  # 41 tokens: five chunks of a budget of 8
SHARED = [1] + [(11 * i) % 290 + 7 for i in range(63)]  # one 64-token prompt: 3 cached blocks of 16 to reuse


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("paged") / "llama", "llama")


@pytest.fixture(scope="module")
def model(llama):
    return load_reference(llama)


def engine(folder: Path, **plugin_args) -> Engine:
    return Engine(EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder), **plugin_args},
                             config=EngineConfig(device=DeviceConfig(target="cpu"))))


def submit_all(eng: Engine, prompts: list[list[int]], tokens: int = TOKENS) -> list:
    futures = [eng.submit({"prompts": [p], "max_tokens": tokens}) for p in prompts]
    return [f.result(timeout=120)[0] for f in futures]


def stats(eng: Engine) -> dict:
    [reply] = eng.collective_rpc("prefix_cache_stats")
    return reply


@pytest.mark.parametrize("caching", [True, False])
def test_chunked_prefill_batched_equals_transformers_with_caching_on_and_off(llama, model, caching) -> None:
    prompts = [LONG, *PROMPTS, LONG, PROMPTS[2]]
    want = {tuple(p): reference(model, p, TOKENS) for p in prompts}
    with engine(llama, max_num_batched_tokens=8, enable_prefix_caching=caching) as eng:
        for out, prompt in zip(submit_all(eng, prompts), prompts):
            assert_matches(out, want[tuple(prompt)])
        [alone] = eng.step({"prompts": [LONG], "max_tokens": TOKENS})  # the whole-request path
        assert_matches(alone, want[tuple(LONG)])
        counted = stats(eng)
    assert (counted["hits"] > 0) == caching  # the second LONG reuses the first one's blocks


def test_a_tight_kv_budget_makes_sequences_wait_and_preempts_with_results_unchanged(llama, model) -> None:
    # 16 blocks of 4 tokens: one sequence of max_model_len=64; each request needs up to 6 blocks
    per_block = 2 * 2 * 2 * 4 * 16 * 4  # keys and values x layers x kv heads x block x head_dim x fp32
    prompts = [PROMPTS[i % 3] for i in range(9)]
    with engine(llama, block_size=4, kv_cache_bytes=16 * per_block, max_model_len=64) as eng:
        outs = submit_all(eng, prompts, TOKENS)
        counted = stats(eng)
    for out, prompt in zip(outs, prompts):
        assert_matches(out, reference(model, prompt, TOKENS))
    assert counted["num_blocks"] == 16 and counted["free_blocks"] == 16
    assert counted["waits"] > 0 and counted["preemptions"] > 0
    assert sum(out.num_preempted for out in outs) == counted["preemptions"]  # each on its own sequence's output


def test_seeded_samples_are_unchanged_by_waiting_preemption_chunks_and_caching(llama) -> None:
    per_block = 2 * 2 * 2 * 4 * 16 * 4
    requests = [{"prompts": [p] * 2, "max_tokens": TOKENS, "temperature": 1.0, "seed": 11 + i, "ignore_eos": True}
                for i, p in enumerate([LONG, *PROMPTS, SHARED[:40]])]

    def run(**plugin_args) -> tuple[list[list[int]], dict]:
        with engine(llama, **plugin_args) as eng:
            futures = [eng.submit(r) for r in requests]
            return [o.token_ids for f in futures for o in f.result(timeout=120)], stats(eng)

    roomy, _ = run(enable_prefix_caching=False)
    tight, counted = run(block_size=4, kv_cache_bytes=16 * per_block, max_model_len=64, max_num_batched_tokens=8)
    assert counted["preemptions"] > 0 and counted["hits"] > 0
    assert tight == roomy and len({tuple(t) for t in roomy}) > len(requests)  # the copies of a prompt differ


def test_eight_requests_of_one_prompt_reuse_its_blocks_with_the_tokens_of_no_caching(llama, model) -> None:
    with engine(llama) as eng:
        cached = submit_all(eng, [SHARED] * 8)
        counted = stats(eng)
    with engine(llama, enable_prefix_caching=False) as eng:
        plain = submit_all(eng, [SHARED] * 8)
        assert stats(eng)["hits"] == 0
    assert counted["hits"] == 7 * 48  # 3 full blocks of 16 (the last token always computed), 7 times
    want = reference(model, SHARED, TOKENS)
    for a, b in zip(cached, plain):
        assert a.token_ids == b.token_ids
        assert_matches(a, want)


def test_no_block_computed_under_old_weights_is_reused_after_an_update(tmp_path) -> None:
    folder = write_checkpoint(tmp_path / "llama", "llama")
    model = load_reference(folder)
    with engine(folder) as eng:
        before = submit_all(eng, [SHARED])[0]
        hits = stats(eng)["hits"]
        perturbed(model, seed=3)
        sender = WeightSender("gloo")
        sender.init_transfer(eng)
        sender.update(eng, model.named_parameters(), version=2)
        after = submit_all(eng, [SHARED])[0]
        assert stats(eng)["hits"] == hits  # the same prompt again: nothing found
        again = submit_all(eng, [SHARED])[0]  # now its blocks under the new weights are found
        assert stats(eng)["hits"] == hits + 48
    assert after.token_ids != before.token_ids and after.weight_version == 2
    assert_matches(after, reference(model, SHARED, TOKENS))
    assert_matches(again, reference(model, SHARED, TOKENS))


def test_dtype_auto_reads_the_checkpoint(llama) -> None:
    arch = Architecture.read(llama)
    cfg = HFCausalLMConfig(model=str(llama), dtype="auto")
    assert arch.dtype == "float32"
    assert cfg.resolved_dtype(arch, "cpu") == "float32" and cfg.resolved_dtype(arch, "cuda") == "bfloat16"
    half = Architecture.read(llama).__class__(**{**arch.__dict__, "dtype": "float16"})
    assert cfg.resolved_dtype(half, "cuda") == "float16" and cfg.resolved_dtype(half, "cpu") == "float32"
    assert HFCausalLMConfig(model=str(llama), dtype="bfloat16").resolved_dtype(arch, "cpu") == "bfloat16"
    assert HFCausalLMConfig(model=str(llama)).resolved_dtype(arch, "cuda") == "bfloat16"  # "auto" by default
    assert HFCausalLMConfig(model=str(llama), dtype="engine").resolved_dtype(arch, "cpu") is None  # params_dtype
    with engine(llama, dtype="auto") as eng:
        [out] = eng.step({"prompts": [PROMPTS[0]], "max_tokens": 4})
    assert out.token_ids


def test_a_budget_below_one_sequence_is_refused_at_load(llama) -> None:
    with pytest.raises(Exception, match=r"fewer than one sequence of max_model_len=256 needs; raise kv_cache_bytes"):
        engine(llama, kv_cache_bytes=1 << 14)


def test_tp2_chunked_and_cached_equals_transformers(ray_session, tmp_path) -> None:
    from tests.hf_checkpoints import SHAPE

    folder = write_checkpoint(tmp_path / "qwen2", "qwen2", tied=True, shape={**SHAPE, "num_key_value_heads": 4})
    model = load_reference(folder)
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))
    args = {"model": str(folder), "max_num_batched_tokens": 8, "block_size": 8}
    prompts = [LONG, PROMPTS[0], SHARED, SHARED, PROMPTS[2]]
    with Engine(EngineArgs(plugin="hf_causal_lm", plugin_args=args,
                           config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel)),
                DeploymentConfig(mode="local", cpus_per_rank=0.5,
                                 process_config=WorkerSupervisorConfig(execution_timeout_s=120))) as eng:
        outs = submit_all(eng, prompts)
        ranks = eng.collective_rpc("prefix_cache_stats", all_ranks=True)
    for out, prompt in zip(outs, prompts):
        assert_matches(out, reference(model, prompt, TOKENS))
    assert ranks[0][0] == ranks[0][1] and ranks[0][0]["hits"] > 0  # both ranks made the same choices
    torch.testing.assert_close(torch.tensor(outs[2].log_probs), torch.tensor(outs[3].log_probs), **against("transformers", "log_probs"))


def resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # a separate head, a tied one
def test_sleep_level2_frees_the_weights_and_the_cache_and_an_update_after_wake_serves_equal_tokens(tmp_path,
                                                                                                   family) -> None:
    from tests.hf_checkpoints import SHAPE

    shape = {**SHAPE, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8}
    folder = write_checkpoint(tmp_path / "big", family, shape=shape, tied=family == "qwen2")  # ~50 MB of fp32
    model = load_reference(folder)
    kv_bytes = 32 << 20
    with engine(folder, kv_cache_bytes=kv_bytes) as eng:
        want = reference(model, PROMPTS[0], TOKENS)
        assert_matches(submit_all(eng, [PROMPTS[0]])[0], want)
        weights = sum(p.numel() * 4 for p in model.parameters())
        before = resident_bytes()
        [report] = eng.sleep(level=2)
        freed = before - resident_bytes()
        assert report.ranks[0]["freed_bytes"] == weights + kv_bytes  # what the model says it freed
        sender = WeightSender("gloo")  # the weights first (the update refills them), then wake_up
        sender.init_transfer(eng)
        sender.update(eng, model.named_parameters(), version=1)
        eng.wake_up(["weights"])
        eng.wake_up(["kv_cache"])
        [out] = submit_all(eng, [PROMPTS[0]])
    assert freed >= 0.85 * (weights + kv_bytes), f"freed {freed >> 20} MiB of {(weights + kv_bytes) >> 20} MiB"
    assert_matches(out, want) and out.weight_version == 1


def test_sleep_level1_frees_the_cache_and_running_sequences_resume_unchanged(llama, model) -> None:
    with engine(llama, max_num_batched_tokens=8) as eng:
        future = eng.submit({"prompts": [LONG], "max_tokens": 40, "ignore_eos": True})
        deadline = time.monotonic() + 60
        while not stats(eng)["running"]:  # its first chunk has run (collective_rpc waits its turn)
            assert time.monotonic() < deadline and not future.done()
        eng.pause(mode="keep")  # held mid-generation, its blocks in the cache
        assert stats(eng)["free_blocks"] < stats(eng)["num_blocks"] and not future.done()
        eng.sleep(level=1)
        assert stats(eng)["free_blocks"] == stats(eng)["num_blocks"] and stats(eng)["waiting"] == 1
        eng.wake_up()
        eng.resume()
        out = future.result(timeout=120)[0]
        [again] = submit_all(eng, [LONG], 40)
    assert out.token_ids == again.token_ids and len(out.token_ids) == 40


def one_rank(folder: Path, **plugin_args):
    """An `HFCausalLM` built on one CPU rank, outside any engine."""
    from phyai_ray.models.hf_causal_lm.model import HFCausalLM
    from phyai_ray.process_groups import GroupSet
    from placement.topology import Topology
    from phyai_ray.plugins.context import RankContext

    parallel = ParallelConfig()
    ctx = RankContext(rank=0, world_size=1, replica_index=0, device=torch.device("cpu"), dtype=torch.float32,
                      parallel=parallel, groups=GroupSet(Topology.from_parallel(parallel), 0))
    return HFCausalLM(HFCausalLMConfig(model=str(folder), **plugin_args), ctx)


def test_sleep_returns_the_bytes_it_freed(llama, model) -> None:
    kv_bytes = 1 << 20
    rank = one_rank(llama, kv_cache_bytes=kv_bytes)
    weights = sum(p.numel() * 4 for name, p in model.named_parameters())
    assert rank.sleep(1) == kv_bytes  # on CPU level 1 frees the cache only (the weights stay where they are)
    assert rank.sleep(1) == 0
    assert rank.sleep(2) == weights  # then the weights, counted once


def test_the_cuda_kv_budget_is_vllm_arithmetic_with_other_processes_counted() -> None:
    from phyai_ray.models.hf_causal_lm.config import CudaMemory, cuda_kv_budget

    gib = 1 << 30
    alone = CudaMemory(total=80 * gib, free_at_start=80 * gib, free_now=64 * gib, peak_activations=2 * gib)
    assert cuda_kv_budget(alone, 0.9) == 72 * gib - 16 * gib - 2 * gib  # 54 GiB
    trainer = alone.model_copy(update={"free_at_start": 40 * gib, "free_now": 24 * gib})  # a trainer holds 40 GiB
    assert cuda_kv_budget(trainer, 0.45) == int(0.45 * 80 * gib) - 16 * gib - 2 * gib
    with pytest.raises(ValueError, match=r"only 42949672960 were free .* lower gpu_memory_utilization to at most 0.500"):
        cuda_kv_budget(trainer, 0.9)
    with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
        cuda_kv_budget(alone, 0.2)
