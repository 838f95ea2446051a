"""`reference_lm`: generation, sampling, TokenOutput, and rollout log-probs equal to the trainer's.

Run: `.venv/bin/pytest tests/test_reference_lm.py` (the TP=2 test starts the session's Ray instance).
"""

from __future__ import annotations

import time

import pytest
import torch

from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine,
                       EngineArgs, EngineConfig, ParallelConfig, ParallelConfigError, TokenOutput)
from phyai_ray.models.reference_lm import ReferenceLMConfig, full_weights, score
from tests.helpers import wait_until

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7}


def _engine(tp: int = 1, **deploy) -> Engine:
    parallel = (ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
                if tp > 1 else ParallelConfig())
    args = EngineArgs(plugin="reference_lm", plugin_args={"seed": 0},
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))
    return Engine(args, DeploymentConfig(**deploy))


def _check_log_probs(outs: list[TokenOutput], prompts: list[list[int]]) -> None:
    weights = full_weights(ReferenceLMConfig(seed=0))
    for prompt, out in zip(prompts, outs):
        want = score(weights, prompt, out.token_ids)
        assert (want - torch.tensor(out.log_probs)).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def single():
    with _engine() as engine:
        yield engine


def test_batched_prompts_of_different_lengths_equal_one_at_a_time(single):
    outs = single.step({"prompts": PROMPTS, "max_tokens": 10})
    assert [o.token_ids for o in outs] == [single.step({"prompts": [p], "max_tokens": 10})[0].token_ids
                                           for p in PROMPTS]
    assert all(len(o.token_ids) == 10 and o.stop_reason == "length" and o.routed_experts is None for o in outs)
    _check_log_probs(outs, PROMPTS)


def test_sampling_is_seeded_and_its_log_probs_match_the_trainer(single):
    a = single.step({"prompts": PROMPTS, "max_tokens": 12, **SAMPLED})
    b = single.step({"prompts": PROMPTS, "max_tokens": 12, **SAMPLED})
    c = single.step({"prompts": PROMPTS, "max_tokens": 12, **{**SAMPLED, "seed": 8}})
    assert [o.token_ids for o in a] == [o.token_ids for o in b] != [o.token_ids for o in c]
    greedy = single.step({"prompts": PROMPTS, "max_tokens": 12})
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]
    _check_log_probs(a, PROMPTS)


def test_stop_tokens_end_a_prompt_with_completed(single):
    free = single.step({"prompts": [PROMPTS[0]], "max_tokens": 8})[0].token_ids
    [out] = single.step({"prompts": [PROMPTS[0]], "max_tokens": 8, "stop_token_ids": [free[3]]})
    assert out.token_ids == free[: free.index(free[3]) + 1] and out.stop_reason == "completed"


def test_bad_requests_and_topologies_are_clear_errors(single):
    with pytest.raises(ValueError, match=r"out-of-range ids \[999\]"):
        single.submit({"prompts": [[1, 999]]})
    with pytest.raises(ValueError, match="exceeds max_seq=256"):
        single.submit({"prompts": [[1] * 250], "max_tokens": 10})
    with pytest.raises(ParallelConfigError, match=r"heads=4 % attention.tp=3"):
        Engine(EngineArgs(plugin="reference_lm", config=EngineConfig(parallel=ParallelConfig(
            dense=DenseParallelConfig(tp_size=3), attention=AttentionParallelConfig(tp_size=3)))))


def test_token_output_fields_and_alias():
    out = TokenOutput([1, 2], [-0.1, -0.2], stop_reason="completed", extra_info={"k": 1})
    assert out.extra_fields == out.extra_info == {"k": 1} and out.num_preempted == 0
    with pytest.raises(ValueError, match="2 token id"):
        TokenOutput([1, 2], [-0.1])
    with pytest.raises(ValueError, match="stop_reason='done'"):
        TokenOutput([1], [-0.1], stop_reason="done")


@pytest.mark.ray
def test_tp2_on_ray_equals_tp1_token_for_token_and_log_probs_match(ray_session, single):
    greedy = {"prompts": PROMPTS, "max_tokens": 12}
    sampled = {**greedy, **SAMPLED}
    with _engine(tp=2, mode="local", cpus_per_rank=0.5) as tp2:
        g2, s2, s2b = tp2.step(greedy), tp2.step(sampled), tp2.step(sampled)
    assert [o.token_ids for o in g2] == [o.token_ids for o in single.step(greedy)]
    assert [o.token_ids for o in s2] == [o.token_ids for o in s2b]
    _check_log_probs(g2, PROMPTS)
    _check_log_probs(s2, PROMPTS)


def _tokens(chunks: list[dict], prompts: int) -> list[list[int]]:
    return [[c["token_ids"][b] for c in chunks if c["token_ids"][b] is not None] for b in range(prompts)]


def test_stream_yields_the_tokens_of_a_plain_call_and_cancel_frees_the_replica(single):
    request = {"prompts": PROMPTS, "max_tokens": 10, "stop_token_ids": [3]}
    chunks = list(single.stream(request))
    assert _tokens(chunks, 3) == [o.token_ids for o in single.step(request)]
    long = single.stream({"prompts": [[1, 2]], "max_tokens": 250})
    assert len([next(long) for _ in range(3)]) == 3
    closed_at = single.batch_stats()[0]["iterations"]
    long.close()  # its sequence leaves at the next iteration, long before its 250 tokens
    wait_until(lambda: single.batch_stats()[0]["running_sequences"] == 0, 10, "the closed stream's sequence dropped")
    assert single.batch_stats()[0]["iterations"] - closed_at < 10
    status = single.replica_status()[0]
    assert status.healthy and status.in_flight == 0 and status.errored == 0
    assert single.step({"prompts": [[1]], "max_tokens": 2})[0].token_ids


def test_a_plugin_without_stream_says_so():
    with Engine(EngineArgs(plugin="tests.plugins.tiny:TinyRowTPEntry", config={"device": {"target": "cpu"}})) as engine:
        with pytest.raises(TypeError, match="has no stream"):
            list(engine.stream({"x": [[1.0] * 8]}))
        assert engine.healthy


def test_a_stream_whose_reader_ends_before_its_future_is_set_waits_for_the_result():
    """The reader may say `done` a moment before the request's future is set; with no timeout (the default
    wait is unbounded) the last wait must be a plain wait, not a wait of an infinite number of seconds."""
    import threading
    from concurrent.futures import Future

    class Ended:
        def read(self, timeout_s):
            return [1], True

        def cancel(self):
            pass

    with Engine(EngineArgs(plugin="tests.plugins.tiny:TinyRowTPEntry", config={"device": {"target": "cpu"}})) as engine:
        future: Future = Future()
        timer = threading.Timer(0.05, future.set_result, ["the result"])
        timer.start()
        stream = engine.read_stream(future, Ended(), None, None)
        assert next(stream) == 1
        with pytest.raises(StopIteration) as end:
            next(stream)
        assert end.value.value == "the result"
        timer.join()


@pytest.mark.ray
def test_tp2_stream_cancel_stops_every_rank_and_engine_actor_streams(ray_session, single):
    import ray

    from phyai_ray import EngineActor

    request = {"prompts": PROMPTS, "max_tokens": 8}
    with _engine(tp=2, mode="local", cpus_per_rank=0.5) as tp2:
        assert _tokens(list(tp2.stream(request)), 3) == [o.token_ids for o in single.step(request)]
        long = tp2.stream({"prompts": [[1, 2]], "max_tokens": 250})
        assert len([next(long) for _ in range(3)]) == 3
        long.close()
        started = time.monotonic()
        assert tp2.step({"prompts": [[1]], "max_tokens": 2})[0].token_ids
        assert time.monotonic() - started < 2.0  # the 250-token generation stopped on both ranks
        wait_until(lambda: tp2.batch_stats()[0]["running_sequences"] == 0, 5, "the left stream's sequence dropped")
        assert tp2.replica_status()[0].healthy
    args = EngineArgs(plugin="reference_lm", plugin_args={"seed": 0, "max_seq": 4096},  # same weights, longer table
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    actor = EngineActor.options(num_cpus=0).remote(args, DeploymentConfig(mode="local", cpus_per_rank=0.5))
    try:
        chunks = [ray.get(ref, timeout=30) for ref in actor.stream.remote(request)]
        assert _tokens(chunks, 3) == [o.token_ids for o in single.step(request)]
        served = ray.get(actor.replica_status.remote(), timeout=10)[0].served
        long_refs = actor.stream.remote({"prompts": [[1, 2]], "max_tokens": 4000})
        assert [ray.get(next(long_refs), timeout=30)["index"] for _ in range(3)] == [0, 1, 2]
        ray.cancel(long_refs)  # the actor's generator is closed: the sequence leaves at the next iteration
        cancelled = time.monotonic()
        wait_until(lambda: ray.get(actor.replica_status.remote(), timeout=10)[0].in_flight == 0, 10,
                   "the cancelled stream's request to leave the engine", interval_s=0.05)
        assert time.monotonic() - cancelled < 3.0
        assert ray.get(actor.replica_status.remote(), timeout=10)[0].served == served  # dropped, not finished
    finally:
        ray.get(actor.close.remote(), timeout=60)
        ray.kill(actor)
