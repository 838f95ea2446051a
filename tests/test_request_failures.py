"""A request's failure is its own (the failure table in docs/concepts/replicas.md).

A sequence whose `admit` raises on every rank, one a Delta or a SequenceError names, one out of
memory: only its request fails, with its own error, and the same rank processes serve on. A plugin's
own validator exception is caught by its class. A long job of short iterations is no hang. Inline and
on one TP=2 Ray group (gloo), shared by the module.
"""

from __future__ import annotations

import time

import pytest

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       ParallelConfig, RequestRejectedError, WorkerSupervisorConfig)
from phyai_ray.errors import OutOfMemoryRequestError, SleepUnsupportedError
from phyai_ray.serve.protocols.error_map import classify
from tests.conftest import held
from tests.plugins.request_failures import FailProbeEntry, MarkedError, NoSleepEntry, OwnPluginError

PLUGIN = f"{FailProbeEntry.__module__}:FailProbeEntry"
CPU = DeviceConfig(target="cpu")
MARKED = (5, 30, 61)  # of 64 concurrent requests


def fail_probe(tp: int = 1, **proc: float) -> Engine:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp)) if tp > 1 else ParallelConfig()
    mode = dict(mode="local", cpus_per_rank=0.5) if tp > 1 else {}
    return Engine(EngineArgs(plugin=PLUGIN, config=EngineConfig(device=CPU, parallel=parallel)),
                  DeploymentConfig(**mode, process_config=WorkerSupervisorConfig(**proc)))


def tokens(prompt: list[int], n: int) -> list[int]:
    return [1000 + 10 * len(prompt) + i for i in range(n)]


@pytest.fixture(scope="module")
def ray_group():
    yield from held(lambda: fail_probe(2, rank_call_timeout_s=60))


@pytest.fixture(scope="module")
def inline():
    with fail_probe(1, rank_call_timeout_s=60) as engine:
        yield engine


@pytest.fixture(params=["inline", "ray_tp2"])
def engine(request):
    return request.getfixturevalue("inline" if request.param == "inline" else "ray_group")


@pytest.mark.parametrize("fail, error", [("admit", MarkedError), ("oom", OutOfMemoryRequestError)])
def test_three_marked_requests_of_64_fail_alone_and_the_same_ranks_serve_on(engine, fail, error):
    pids = engine.replica_status()[0].pids
    requests = [{"prompts": [[1 + i % 4]], "max_tokens": 3, **({"fail": fail} if i in MARKED else {})}
                for i in range(64)]
    futures = [engine.submit(r) for r in requests]
    for i, future in enumerate(futures):
        if i in MARKED:
            with pytest.raises(error, match="sequence \\d+ ") as info:
                future.result(timeout=30)
            assert "prompts" not in str(info.value)
        else:
            assert future.result(timeout=30)[0].token_ids == tokens([1 + i % 4], 3)
    status = engine.replica_status()[0]
    assert status.healthy and status.pids == pids
    assert engine.step({"prompts": [[9]], "max_tokens": 2}, timeout=30)[0].token_ids == tokens([9], 2)
    if fail == "oom":  # answered 503 out_of_memory, with Retry-After
        failure = classify(info.value)
        assert (failure.status, failure.kind, failure.retry_after) == (503, "out_of_memory", True)


def test_a_sequence_refused_on_one_rank_only_fails_alone_on_every_rank(ray_group):
    """Rank 1 alone refuses 3 of 64 sequences in `admit` (rank 0 admits them). The ranks exchange their
    verdicts before the iteration's all-reduce over the running ids (`agree_admissions`), so both drop
    the 3, each of those requests fails alone with an error naming the rank, the other 61 finish on the
    same rank processes, and every iteration's all-reduce saw the same sequences on both ranks."""
    pids = ray_group.replica_status()[0].pids
    requests = [{"prompts": [[1 + i % 4]], "max_tokens": 3, **({"fail": "admit_rank1"} if i in MARKED else {})}
                for i in range(64)]
    futures = [ray_group.submit(r) for r in requests]
    for i, future in enumerate(futures):
        if i in MARKED:
            with pytest.raises(RuntimeError, match=r"sequence \d+ was failed on rank\(s\) \[1\] of 2 while it "
                                                   r"was admitted; every rank of the replica dropped it"):
                future.result(timeout=30)
        else:
            assert future.result(timeout=30)[0].token_ids == tokens([1 + i % 4], 3)
    status = ray_group.replica_status()[0]
    assert status.healthy and status.pids == pids
    assert ray_group.collective_rpc("agreed", all_ranks=True, timeout=30)[0] == [True, True]


def test_a_delta_error_fails_its_request_alone(engine):
    beside = [engine.submit({"prompts": [[2]], "max_tokens": 6}) for _ in range(4)]
    marked = engine.submit({"prompts": [[3]], "max_tokens": 6, "fail": "delta"})
    with pytest.raises(MarkedError, match="failed in its decode"):
        marked.result(timeout=30)
    assert [f.result(timeout=30)[0].token_ids for f in beside] == [tokens([2], 6)] * 4
    assert engine.replica_status()[0].healthy


def test_a_plugins_own_validator_error_is_caught_by_its_class(engine):
    try:
        engine.step({"prompts": [[1]], "refuse": True}, timeout=30)
    except OwnPluginError as exc:  # the plugin's own class, as before validation moved into one place
        assert isinstance(exc, RequestRejectedError) and isinstance(exc.__cause__, OwnPluginError)
    else:
        pytest.fail("the refusal was not raised")
    assert engine.step({"prompts": [[4]], "max_tokens": 2}, timeout=30)[0].token_ids == tokens([4], 2)


def test_a_sequence_error_fails_the_sequences_it_names_and_the_iteration_runs_again(inline):
    beside = inline.submit({"prompts": [[1]], "max_tokens": 8})
    marked = inline.submit({"prompts": [[2]], "max_tokens": 8, "fail": "sequence"})
    with pytest.raises(MarkedError, match="failed in iterate"):
        marked.result(timeout=30)
    assert beside.result(timeout=30)[0].token_ids == tokens([1], 8)


def test_out_of_memory_in_an_iteration_fails_what_it_admitted_and_retries_the_others(inline):
    running = inline.submit({"prompts": [[1]], "max_tokens": 40, "sleep": 0.01})
    while not inline.replica_status()[0].in_flight:
        time.sleep(0.01)
    time.sleep(0.05)  # it runs: its iterations are past
    marked = inline.submit({"prompts": [[2]], "max_tokens": 4, "fail": "iterate_oom"})
    with pytest.raises(OutOfMemoryRequestError, match="in the iteration that admitted it"):
        marked.result(timeout=30)
    assert running.result(timeout=30)[0].token_ids == tokens([1], 40)


def test_a_long_job_of_short_iterations_is_no_hang():
    """40 iterations of 0.1 s under a 2 s hang limit, no execution_timeout_s: it completes."""
    with fail_probe(1, rank_call_timeout_s=2.0) as engine:
        started = time.monotonic()
        assert engine.step({"prompts": [[1]], "max_tokens": 40, "sleep": 0.1})[0].token_ids == tokens([1], 40)
        assert time.monotonic() - started > 4.0


def test_sleep_reports_freed_bytes_or_refuses():
    with fail_probe(1) as engine:
        [report] = engine.sleep(level=2)
        assert report.ranks == ({"rank": 0, "level": 2, "freed_bytes": 4},)  # iter_probe's one float32 scale
    no_sleep = f"{NoSleepEntry.__module__}:NoSleepEntry"
    with Engine(EngineArgs(plugin=no_sleep, config=EngineConfig(device=CPU)), DeploymentConfig()) as engine:
        with pytest.raises(SleepUnsupportedError, match="plugin no_sleep: .* defines no sleep"):
            engine.sleep(level=1)
        assert engine.replica_status()[0].state == "SERVING" and engine.step(7) == 7


def test_ranks_that_name_different_failed_sequences_fail_the_replica():
    """The agreement rule of a Ray group (RayExecutor._on_iteration), on replies as the lanes hand them over."""
    from types import SimpleNamespace

    from actors.protocol import OK, RankReply
    from actors.ray_executor import RayExecutor, _Sent
    from phyai_ray.plugins.iteration import RankIteration

    def run(replies: dict) -> tuple[list, list]:
        delivered, failed = [], []
        executor = object.__new__(RayExecutor)
        executor.output_rank = 0
        executor._link = SimpleNamespace(deliver=lambda work, value: delivered.append(value), fail=failed.append,
                                         failure=lambda: None)
        executor.health = SimpleNamespace(disagreement=lambda kinds: f"disagree {kinds}")
        sent = _Sent(0, set(replies))
        for rank, value in replies.items():
            sent.replies[rank] = RankReply(0, rank, OK, value)
            sent.pending.discard(rank)
            executor._on_iteration(None, sent, rank)
        return delivered, failed

    error = MarkedError("sequence 3 was marked to fail in admit")
    agreed = RankIteration({1: "delta"}, {3: error}, {3: "MarkedError"})
    assert run({0: agreed, 1: RankIteration(None, {}, {3: "MarkedError"})}) == ([agreed], [])
    assert run({1: RankIteration(None, {}, {3: "MarkedError"}), 0: agreed}) == ([agreed], [])
    delivered, failed = run({0: agreed, 1: None})  # rank 1 admitted sequence 3: the ranks diverged
    assert delivered == [] and failed == ["disagree {0: {3: 'MarkedError'}, 1: {}}"]
    clean = RankIteration({1: "delta"}, {}, {})
    delivered, failed = run({0: clean, 1: RankIteration(None, {}, {3: "KeyError"})})
    assert delivered == [clean] and failed == ["disagree {0: {}, 1: {3: 'KeyError'}}"]
