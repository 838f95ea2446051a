"""`reference_lm` under the iteration protocol: sequences join and leave one batched loop.

Every test drives one inline rank's model (`admit` / `drop` / `recompute` / `iterate`) directly,
no engine and no Ray, and compares numbers: a sequence run beside others equals the same sequence
run alone, and its log-probs equal the trainer's `score`.

Run: `.venv/bin/pytest tests/test_reference_lm_iterations.py -q -s` (-s shows the timing line).
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from phyai_ray import DeviceConfig, ParallelConfig
from phyai_ray.executors.inline import build_inline_runner
from phyai_ray.models.reference_lm import ReferenceLMConfig, ReferenceLMEntry, full_weights, score
from phyai_ray.llm.sampling import sequence_seed

WEIGHTS = full_weights(ReferenceLMConfig(seed=0))
SAMPLED = {"temperature": 0.9, "top_k": 20, "top_p": 0.9}
BATCHED = 0.5  # a 64-sequence decode iteration's most time per token, as a share of a lone sequence's


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


@pytest.fixture
def model():
    entry = ReferenceLMEntry({"seed": 0})
    return build_inline_runner(entry, {"seed": 0}, ParallelConfig(), DeviceConfig(target="cpu")).model


def seq(prompt: list[int], max_tokens: int = 8, seed: int = 0, stop: tuple[int, ...] = (), **sampling) -> dict:
    """An `admit` payload; greedy unless sampling parameters are given."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
            "seed": seed, "stop_token_ids": list(stop), **sampling}


def drive(model, admits: dict[int, list], drops: dict[int, list] | None = None,
          before: dict[int, object] | None = None) -> dict[int, dict]:
    """Iterate until nothing runs; before iteration t: `before[t](model)`, drop `drops[t]`, admit `admits[t]`.

    Returns per sequence its tokens, log-probs, stop reason, the iteration it ended in and its preemptions.
    """
    drops, before, out, t = drops or {}, before or {}, {}, 0
    while t <= max([*admits, *drops, *before]) or model.paged:
        if t in before:
            before[t](model)
        for seq_id in drops.get(t, ()):
            model.drop(seq_id)
        for seq_id, payload in admits.get(t, ()):
            model.admit(seq_id, payload)
        for seq_id, delta in model.iterate().items():
            got = out.setdefault(seq_id, {"tokens": [], "log_probs": [], "stop": None, "ended": None, "preempted": 0})
            got["tokens"] += delta.token_ids
            got["preempted"] += delta.preempted
            got["log_probs"] += delta.log_probs
            got["stop"], got["ended"] = delta.stop_reason, t
        t += 1
    return out


def alone(model, payload: dict) -> dict:
    return drive(model, {0: [(0, payload)]})[0]


def assert_scored(got: dict, prompt: list[int], weights=WEIGHTS) -> None:
    want = score(weights, prompt, got["tokens"])
    assert (want - torch.tensor(got["log_probs"])).abs().max().item() <= 1e-5


def test_a_short_sequence_admitted_while_a_long_one_runs_finishes_first_and_both_equal_alone(model):
    long, short = seq([5, 6, 7, 8, 9], max_tokens=40), seq([1, 2, 3], max_tokens=5)
    out = drive(model, {0: [(1, long)], 3: [(2, short)]})
    assert out[2]["ended"] == 3 + 4 < out[1]["ended"] == 39
    for seq_id, payload in ((1, long), (2, short)):
        assert out[seq_id]["tokens"] == alone(model, payload)["tokens"]
        assert out[seq_id]["stop"] == "length"
        assert_scored(out[seq_id], payload["prompt"])


def test_greedy_sequences_admitted_at_different_iterations_equal_each_run_alone(model):
    payloads = {1: seq([4], 12), 2: seq(list(range(10, 17)), 9), 3: seq([3, 1, 4], 15), 4: seq(list(range(30, 42)), 6)}
    out = drive(model, {0: [(1, payloads[1]), (2, payloads[2])], 2: [(3, payloads[3])], 5: [(4, payloads[4])]})
    for seq_id, payload in payloads.items():
        assert out[seq_id]["tokens"] == alone(model, payload)["tokens"]
        assert len(out[seq_id]["tokens"]) == payload["max_tokens"]
        assert_scored(out[seq_id], payload["prompt"])


def test_a_stop_token_ends_a_sequence_with_completed_and_frees_its_blocks(model):
    free = alone(model, seq([1, 2, 3], 10))["tokens"]
    out = drive(model, {0: [(1, seq([1, 2, 3], 10, stop=(free[4],))), (2, seq([7, 7], 10))]})
    assert out[1]["tokens"] == free[: free.index(free[4]) + 1] and out[1]["stop"] == "completed"
    assert out[2]["stop"] == "length" and not model.paged
    assert model.paged.pool.free_count == model.paged.pool.num_blocks


def test_a_seeded_sampled_sequence_draws_the_same_tokens_whatever_runs_beside_it(model):
    mine = seq([2, 4, 6], 24, seed=11, **SAMPLED)
    crowd = drive(model, {0: [(1, seq([9, 9, 9, 9], 30, seed=3, **SAMPLED)), (2, seq([5], 6))],
                          2: [(7, mine)], 4: [(3, seq([8, 1], 30, seed=4, **SAMPLED))], 9: [(4, seq([1] * 9, 30))]},
                  drops={3: [1], 6: [3], 12: [4]})
    lonely = alone(model, mine)
    assert crowd[7]["tokens"] == lonely["tokens"]
    assert_scored(crowd[7], mine["prompt"])
    greedy = alone(model, {**mine, "temperature": 0.0})["tokens"]
    other_seed = alone(model, {**mine, "seed": 12})["tokens"]
    assert lonely["tokens"] != greedy and lonely["tokens"] != other_seed


def test_drop_frees_its_blocks_and_every_block_is_accounted_for_over_many_cycles(model):
    rng, running, payloads, dropped, out = random.Random(0), set(), {}, {}, {}
    pool, most, next_id = model.paged.pool, 8, 0
    for t in range(120):
        if running and rng.random() < 0.3:
            victim = rng.choice(sorted(running))
            model.drop(victim)
            running.discard(victim)
            dropped[victim] = t
        while len(running) < most and rng.random() < 0.5:
            prompt = [rng.randrange(128) for _ in range(rng.randrange(1, 12))]
            sampling = [SAMPLED, {"temperature": 1.0}, {}][next_id % 3]  # filtered, plain, greedy
            payloads[next_id] = seq(prompt, rng.randrange(1, 16), seed=next_id, **sampling)
            model.admit(next_id, payloads[next_id])
            running.add(next_id)
            next_id += 1
        for seq_id, delta in model.iterate().items():
            out.setdefault(seq_id, []).extend(delta.token_ids)
            if delta.stop_reason:
                running.discard(seq_id)
        held = [b for s in model.paged.running for b in s.blocks]  # a shared block once per holder
        assert {s.seq_id for s in model.paged.running + model.paged.waiting} == running == set(model.paged.by_id)
        assert sum(pool.refs) == len(held) and pool.free_count == pool.num_blocks - len(set(held))
    assert next_id > 4 * most and len(dropped) > most
    for seq_id in list(running):
        model.drop(seq_id)
    assert pool.free_count == pool.num_blocks and sum(pool.refs) == 0
    for seq_id, payload in payloads.items():
        tokens = alone(model, payload)["tokens"]
        assert out.get(seq_id, []) == tokens[: len(out.get(seq_id, []))]
        if seq_id not in dropped and seq_id not in running:
            assert out[seq_id] == tokens


def test_more_sequences_than_the_blocks_hold_wait_and_each_equals_its_run_alone(model):
    args = {"seed": 0, "kv_cache_blocks": 16}  # one block per sequence below: 16 run, 3 wait
    small = build_inline_runner(ReferenceLMEntry(args), args, ParallelConfig(), DeviceConfig(target="cpu")).model
    payloads = {i: seq([i + 1, i + 2], 3 + i % 4) for i in range(19)}
    out = drive(small, {0: list(payloads.items())})
    assert small.paged.waits > 0 and small.paged.pool.free_count == 16
    assert all(out[i]["tokens"] == alone(model, p)["tokens"] for i, p in payloads.items())
    with pytest.raises(ValueError, match=r"kv_cache_blocks=15 holds fewer than one sequence of max_seq=256"):
        ReferenceLMConfig(kv_cache_blocks=15)


def test_recompute_after_new_weights_scores_the_next_tokens_under_them(model):
    new_weights = full_weights(ReferenceLMConfig(seed=1))
    payloads = {1: seq([1, 2, 3], 12), 2: seq([4, 5], 12, seed=5, **SAMPLED), 3: seq([1, 2, 3], 12)}
    history = {}

    def swap_and_recompute(m):  # before iteration 4: every sequence holds 4 tokens, the last one not yet fed
        m.load_weights(list(new_weights.items()))
        for seq_id in (1, 2):
            m.recompute(seq_id)
        history.update({s.seq_id: s.prompt + s.tokens for s in m.paged.by_id.values()})

    out = drive(model, {0: list(payloads.items())}, before={4: swap_and_recompute})
    for seq_id, payload in payloads.items():
        old_part, new_part = ({k: out[seq_id][k][part] for k in ("tokens", "log_probs")}
                              for part in (slice(None, 4), slice(4, None)))
        assert_scored(old_part, payload["prompt"])
        assert len(new_part["tokens"]) == 8
        if seq_id in (1, 2):
            assert_scored(new_part, history[seq_id], new_weights)
        else:  # not recomputed: its cache still holds the old weights' keys and values
            want = score(new_weights, history[seq_id], new_part["tokens"])
            assert (want - torch.tensor(new_part["log_probs"])).abs().max().item() > 1e-3


def test_recompute_under_the_same_weights_changes_nothing_and_keeps_the_generator(model):
    payload = seq([6, 2, 8], 14, seed=9, **SAMPLED)
    plain = alone(model, payload)
    rebuilt = drive(model, {0: [(1, payload)]}, before={3: lambda m: m.recompute(1), 9: lambda m: m.recompute(1)})[1]
    assert rebuilt["tokens"] == plain["tokens"]
    assert (torch.tensor(rebuilt["log_probs"]) - torch.tensor(plain["log_probs"])).abs().max().item() <= 1e-5


@pytest.mark.parametrize("sampling", [{}, {**SAMPLED, "seed": 21}], ids=["greedy", "seeded"])
def test_step_equals_the_protocol_path_of_the_same_request(model, sampling):
    entry = ReferenceLMEntry({"seed": 0})
    request = {"prompts": [[1, 2, 3], [1, 2, 3], [7], [4, 5, 6, 7, 8]], "max_tokens": 10, **sampling}
    sequences = entry.sequences(request)
    assert [s.cost for s in sequences] == [3, 3, 1, 5]
    seeds = [s.payload["seed"] for s in sequences]
    if "seed" in sampling:
        assert seeds == [sequence_seed(sampling["seed"], i) for i in range(4)]
    else:  # unseeded: every sequence its own fresh seed (greedy ignores them)
        assert len(set(seeds)) == 4
    traffic, stepped = seq([9, 8, 7], 20, seed=1, **SAMPLED), []
    beside = drive(model, {0: [(100, traffic)]}, before={3: lambda m: stepped.append(m.step(request))})
    assert beside[100]["tokens"] == alone(model, traffic)["tokens"]  # step() ran beside it, on the same pool
    [stepped] = stepped
    protocol = drive(model, {0: [(i, s.payload) for i, s in enumerate(sequences)]})
    assert [o.token_ids for o in stepped] == [protocol[i]["tokens"] for i in range(4)]
    for i, o in enumerate(stepped):
        assert (torch.tensor(o.log_probs) - torch.tensor(protocol[i]["log_probs"])).abs().max().item() <= 1e-5
    assert [o.token_ids for o in entry.gather(request, stepped)] == [o.token_ids for o in stepped]
    if sampling:
        assert stepped[0].token_ids != stepped[1].token_ids  # one seed, two prompts: two different draws


def test_a_step_that_needs_the_blocks_the_protocol_holds_takes_them_and_both_equal_alone(model):
    args = {"seed": 0, "kv_cache_blocks": 16}  # 16 blocks of 16 tokens: one sequence of max_seq=256
    small = build_inline_runner(ReferenceLMEntry(args), args, ParallelConfig(), DeviceConfig(target="cpu")).model
    traffic = seq(list(range(1, 41)), 20, seed=2, **SAMPLED)  # 3 blocks once running
    request = {"prompts": [[(7 * i) % 128 for i in range(200)]], "max_tokens": 50}  # 250 tokens: all 16 blocks
    stepped, preempted = [], []

    def step(m):
        stepped.append(m.step(request))
        preempted.append(m.paged.preemptions)

    beside = drive(small, {0: [(1, traffic)]}, before={2: step})
    [[out]] = stepped
    assert preempted == [1] and beside[1]["preempted"] == 1 and small.paged.pool.free_count == 16
    assert out.token_ids == model.step(request)[0].token_ids and out.stop_reason == "length"
    assert beside[1]["tokens"] == alone(model, traffic)["tokens"]
    assert_scored(beside[1], traffic["prompt"])


def test_bad_admissions_are_clear_errors(model):
    model.admit(1, seq([1, 2]))
    with pytest.raises(ValueError, match=r"sequence 1 is already running"):
        model.admit(1, seq([3]))
    with pytest.raises(ValueError, match=r"max_seq=256; got 250 prompt id\(s\) and max_tokens=10"):
        model.admit(2, seq([1] * 250, 10))
    with pytest.raises(ValueError, match=r"payload lacks \['seed'\]"):
        model.admit(3, {k: v for k, v in seq([1]).items() if k != "seed"})
    model.drop(99)  # unknown ids: nothing to do
    model.recompute(99)
    assert list(model.iterate()) == [1] and list(model.paged.by_id) == [1]


def test_a_decode_iteration_of_64_sequences_is_one_forward_and_costs_under_half_of_64_lone_ones(model):
    """64 running sequences (8-token prompts) decode in ONE forward per iteration, each getting its
    token, and that iteration takes at most a BATCHED share of 64 iterations of one lone sequence:
    batching at least halves the time per token. Measured side by side (interleaved), median of 32."""
    solo = build_inline_runner(ReferenceLMEntry({"seed": 0}), {"seed": 0}, ParallelConfig(),
                               DeviceConfig(target="cpu")).model
    prompts = torch.randint(0, 128, (64, 8), generator=torch.Generator().manual_seed(0)).tolist()
    for i, prompt in enumerate(prompts):
        model.admit(i, seq(prompt, 200, seed=i))
    solo.admit(0, seq(prompts[0], 200))
    model.iterate(), solo.iterate()
    forwards, logits = [], model.logits
    model.logits = lambda batch, pool: forwards.append(batch.last.numel()) or logits(batch, pool)
    batched, lone = [], []
    for _ in range(32):
        started = time.perf_counter()
        deltas = model.iterate()
        batched.append(time.perf_counter() - started)
        assert sorted(deltas) == list(range(64)) and all(len(d.token_ids) == 1 for d in deltas.values())
        started = time.perf_counter()
        solo.iterate()
        lone.append(time.perf_counter() - started)
    assert forwards == [64] * 32
    median = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    print(f"\ndecode iteration: 64 sequences {median(batched):.2f} ms, one sequence {median(lone):.2f} ms "
          f"(median of 32, {torch.get_num_threads()} thread)")
    assert median(batched) <= BATCHED * 64 * median(lone)
