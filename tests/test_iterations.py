"""Continuous batching (the iteration protocol) with `iter_probe`, inline and on a real Ray group (TP=2, gloo).

Run: flock /tmp/phyai-ray-tests.lock .venv/bin/pytest tests/test_iterations.py -q

`iter_probe` records every plan on every rank and all-reduces a checksum of its running sequences
each iteration, so these tests see what reached the ranks: a short request admitted beside a long
one finishes first; every rank ran the same iterations; cancel, a leaving stream consumer and a
deadline free the slot at the next iteration; max_num_seqs and max_num_batched_tokens bound each
iteration; pause abort / keep / wait act at iteration boundaries; a weight update between
iterations shows in the per-token weight versions; overload sheds with EngineOverloadedError and
loses nothing.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from phyai_ray import (BatchingConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs,
                       EngineConfig, EngineOverloadedError, ParallelConfig, RequestAbortedError, RequestTimeoutError,
                       WeightSender, WorkerSupervisorConfig)
from tests.conftest import closed_without_leaks, init_local_ray
from tests.helpers import wait_until
from tests.plugins.iterating import IterProbeEntry

PLUGIN = f"{IterProbeEntry.__module__}:IterProbeEntry"
CPU = DeviceConfig(target="cpu")


def probe_engine(tp: int = 1, *, batching: BatchingConfig | None = None, timeout_s: float = 60.0,
                 max_queued: int = 4096) -> Engine:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp)) if tp > 1 else ParallelConfig()
    proc = WorkerSupervisorConfig(execution_timeout_s=timeout_s, max_queued_requests=max_queued)
    mode = dict(mode="local", cpus_per_rank=0.5) if tp > 1 else {}
    return Engine(EngineArgs(plugin=PLUGIN, config=EngineConfig(device=CPU, parallel=parallel)),
                  DeploymentConfig(**mode, process_config=proc, batching=batching or BatchingConfig()))


def expected_tokens(prompt: list[int], n: int, scale: int = 1) -> list[int]:
    return [1000 * scale + 10 * len(prompt) + i for i in range(n)]


@pytest.fixture(scope="module")
def ray_probe():
    init_local_ray()
    engine = probe_engine(2, timeout_s=60.0)
    yield from closed_without_leaks(engine)


@pytest.fixture(scope="module")
def inline_probe():
    with probe_engine(1, timeout_s=60.0) as engine:
        yield engine


@pytest.fixture(params=["inline", "ray_tp2"])
def probe(request):
    return request.getfixturevalue("inline_probe" if request.param == "inline" else "ray_probe")


def wait_running(engine: Engine, n: int) -> None:
    wait_until(lambda: engine.batch_stats()[0]["running_sequences"] == n, 10, f"{n} running sequence(s)",
               interval_s=0.002)


def plans(engine: Engine) -> list:
    return engine.collective_rpc("plans", all_ranks=True)[0]


def test_a_short_request_admitted_beside_a_long_one_finishes_first_and_ranks_agree(probe):
    long = probe.submit({"prompts": [[1, 2, 3]], "max_tokens": 60, "sleep": 0.005})
    wait_running(probe, 1)
    short = probe.submit({"prompts": [[4], [5, 6]], "max_tokens": 3})
    [a, b] = short.result(timeout=30)
    assert not long.done(), "the short request waited for the long one"
    assert a.token_ids == expected_tokens([4], 3) and b.token_ids == expected_tokens([5, 6], 3)
    assert a.stop_reason == b.stop_reason == "length" and a.log_probs == [-1.0, -2.0, -3.0]
    [out] = long.result(timeout=30)
    assert out.token_ids == expected_tokens([1, 2, 3], 60)
    ranks = probe.collective_rpc("plans", all_ranks=True)[0]
    assert all(r == ranks[0] for r in ranks), "ranks saw different plans"
    assert all(probe.collective_rpc("agreed", all_ranks=True)[0]), "ranks ran different sequences"
    assert probe.collective_rpc("slots", all_ranks=True)[0] == [0] * probe.replica_status()[0].world_size


def test_cancel_and_a_leaving_stream_free_the_slot_at_the_next_iteration(probe):
    before = len(plans(probe)[0])
    future = probe.submit({"prompts": [[7]], "max_tokens": 10_000, "sleep": 0.002})
    wait_running(probe, 1)
    assert future.cancel() and future.cancelled()
    wait_until(lambda: probe.batch_stats()[0]["running_sequences"] == 0, 5, "the cancelled sequence dropped")
    stream = probe.stream({"prompts": [[8, 9]], "max_tokens": 10_000, "sleep": 0.002})
    chunks = [next(stream) for _ in range(5)]
    stream.close()
    assert [c["token_ids"] for c in chunks] == [[t] for t in expected_tokens([8, 9], 5)]
    assert [c["index"] for c in chunks] == list(range(5))
    wait_until(lambda: probe.collective_rpc("slots", all_ranks=True)[0] == [0] * probe.replica_status()[0].world_size,
               5, "both slots freed on every rank")
    dropped = [i for p in plans(probe)[0][before:] for i in p[1]]
    assert len(dropped) == 2, dropped
    [ok] = probe.step({"prompts": [[1]], "max_tokens": 2})
    assert ok.token_ids == expected_tokens([1], 2)


def test_a_deadline_drops_the_sequence_and_the_replica_keeps_serving():
    with probe_engine(1, timeout_s=0.5) as engine:
        future = engine.submit({"prompts": [[1]], "max_tokens": 10_000, "sleep": 0.002})
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError, match="sequences were dropped at the next iteration"):
            future.result(timeout=10)
        assert time.monotonic() - started < 2.0
        wait_until(lambda: engine.collective_rpc("slots") == [0], 5, "the expired sequence dropped")
        [out] = engine.step({"prompts": [[2, 3]], "max_tokens": 3})
        assert out.token_ids == expected_tokens([2, 3], 3) and engine.replica_status()[0].healthy


def test_max_num_seqs_and_the_token_budget_bound_every_iteration():
    batching = BatchingConfig(max_num_seqs=4, max_num_batched_tokens=12)
    with probe_engine(1, batching=batching) as engine:
        futures = [engine.submit({"prompts": [[1] * (1 + i % 5)], "max_tokens": 3 + i % 4}) for i in range(40)]
        huge = engine.submit({"prompts": [[2] * 30], "max_tokens": 2})  # longer than the budget: runs alone
        for i, f in enumerate(futures):
            assert f.result(timeout=30)[0].token_ids == expected_tokens([1] * (1 + i % 5), 3 + i % 4)
        assert huge.result(timeout=30)[0].token_ids == expected_tokens([2] * 30, 2)
        remaining, peak = {}, 0  # replay the plans: sequence i (1-based) is request i - 1, 41 is `huge`
        for admitted, dropped, _ in engine.collective_rpc("plans")[0]:
            assert not dropped
            fresh = sum(30 if i == 41 else 1 + (i - 1) % 5 for i in admitted)
            if remaining or len(admitted) > 1:
                assert fresh + len(remaining) <= 12, (admitted, sorted(remaining))
            remaining.update({i: 2 if i == 41 else 3 + (i - 1) % 4 for i in admitted})
            peak = max(peak, len(remaining))
            remaining = {i: n - 1 for i, n in remaining.items() if n > 1}
        assert peak == 4 and not remaining


def test_pause_abort_returns_partials_and_fails_what_never_ran(probe):
    running = probe.submit({"prompts": [[1], [2, 3]], "max_tokens": 10_000, "sleep": 0.002})
    wait_running(probe, 2)
    probe.pause(mode="keep")
    queued = probe.submit({"prompts": [[4]], "max_tokens": 3})
    [report] = probe.pause(mode="abort")
    assert report.aborted == 2
    a, b = running.result(timeout=10)
    assert a.stop_reason == b.stop_reason == "aborted" and a.token_ids == expected_tokens([1], len(a.token_ids))
    assert len(a.token_ids) > 0 and b.token_ids == expected_tokens([2, 3], len(b.token_ids))
    with pytest.raises(RequestAbortedError, match="before any of its sequences reached a rank"):
        queued.result(timeout=10)
    probe.resume()
    wait_until(lambda: probe.collective_rpc("slots", all_ranks=True)[0] == [0] * probe.replica_status()[0].world_size,
               5, "the aborted sequences dropped on every rank")
    assert probe.step({"prompts": [[5]], "max_tokens": 2})[0].token_ids == expected_tokens([5], 2)


def test_pause_keep_freezes_and_a_weight_update_shows_in_per_token_versions(probe):
    sender = WeightSender("object_store")
    sender.init_transfer(probe)
    before = len(plans(probe)[0])
    future = probe.submit({"prompts": [[1, 2]], "max_tokens": 400, "sleep": 0.002})
    wait_running(probe, 1)
    probe.pause(mode="keep")  # returns at once; the iteration at the ranks (if any) still ends
    time.sleep(0.05)
    frozen = probe.batch_stats()[0]["iterations"]
    time.sleep(0.1)
    assert probe.batch_stats()[0]["iterations"] == frozen, "a paused replica kept iterating"
    reports = sender.update(probe, [("scale", torch.full((1,), 2.0))], version=7)
    assert [r.error for r in reports] == [None]
    probe.resume()
    [out] = future.result(timeout=30)
    switch = out.weight_versions.index(7)
    assert 0 < switch < 400 and set(out.weight_versions[:switch]) == {out.weight_versions[0]}
    assert set(out.weight_versions[switch:]) == {7} and out.max_weight_version == 7
    assert out.token_ids[:switch] == [t for t in expected_tokens([1, 2], switch, scale=1)]
    assert out.token_ids[switch:] == [2000 + 20 + i for i in range(switch, 400)]
    assert future.weight_version == 7 and out.weight_version == 7
    recomputed = [i for p in plans(probe)[0][before:] for i in p[2]]
    assert len(recomputed) == 1, recomputed  # cache_after_update="recompute": rebuilt once, after the update
    sender.update(probe, [("scale", torch.full((1,), 1.0))], version=8)  # back to the tokens the others expect


def test_pause_wait_lets_running_sequences_finish_and_admits_none(inline_probe):
    engine = inline_probe
    running = engine.submit({"prompts": [[1]], "max_tokens": 200, "sleep": 0.005})
    wait_running(engine, 1)
    [report] = engine.pause(mode="wait", timeout=30)
    assert running.done() and running.result()[0].stop_reason == "length" and report.state == "PAUSED"
    later = engine.submit({"prompts": [[2]], "max_tokens": 2})
    time.sleep(0.05)
    assert not later.done() and engine.replica_status()[0].queued == 1
    engine.resume()
    assert later.result(timeout=10)[0].token_ids == expected_tokens([2], 2)


def test_overload_sheds_with_a_clear_error_and_loses_nothing():
    with probe_engine(1, max_queued=50) as engine:
        engine.pause(mode="keep")
        admitted, shed = [], 0
        for i in range(80):
            try:
                admitted.append(engine.submit({"prompts": [[1 + i % 3]], "max_tokens": 2}))
            except EngineOverloadedError as exc:
                shed += 1
                assert "max_queued_requests=50" in str(exc)
        assert len(admitted) == 50 and shed == 30 and engine.replica_status()[0].queued == 50
        engine.resume()
        assert all(f.result(timeout=30)[0].token_ids == expected_tokens([1 + i % 3], 2) for i, f in enumerate(admitted))
        status = engine.replica_status()[0]
        assert status.in_flight == 0 and status.served == 50


def test_an_iteration_that_raises_fails_its_sequences_only_inline():
    with probe_engine(1) as engine:
        beside = engine.submit({"prompts": [[1]], "max_tokens": 30, "sleep": 0.002})
        bad = engine.submit({"prompts": [[2]], "max_tokens": 30, "raise_at": 5})
        for future in (bad, beside):  # beside shared the iteration that raised: the error names the cause's
            with pytest.raises(RuntimeError, match="an iteration raised RuntimeError in the shared forward") as info:
                future.result(timeout=10)  # type and the sequences, never the cause's message (the log has it)
            assert "asked to raise" not in str(info.value)
        [out] = engine.step({"prompts": [[3]], "max_tokens": 2})
        assert out.token_ids == expected_tokens([3], 2) and engine.replica_status()[0].healthy


def test_done_callbacks_may_call_the_engine_again(inline_probe):
    engine, replies, done = inline_probe, [], threading.Event()

    def again(future) -> None:  # runs on the engine's delivery thread, never on the loop's
        replies.append(engine.step({"prompts": [[len(future.result()[0].token_ids)]], "max_tokens": 2}, timeout=10))
        done.set()

    futures = [engine.submit({"prompts": [[1]], "max_tokens": 3 + i}) for i in range(20)]
    futures[-1].add_done_callback(again)
    assert done.wait(20) and replies[0][0].token_ids == expected_tokens([22], 2)
    assert all(f.result(timeout=10)[0].token_ids == expected_tokens([1], 3 + i) for i, f in enumerate(futures))


def test_a_rank_killed_mid_iteration_fails_every_sequence_soon_and_nothing_hangs(ray_probe):
    """Its own group (`ray_probe`'s teardown checks that neither left an actor or placement group behind)."""
    import os
    import signal

    from phyai_ray import EngineUnavailableError

    engine = probe_engine(2, timeout_s=60.0)
    try:
        futures = [engine.submit({"prompts": [[1 + i]], "max_tokens": 100_000, "sleep": 0.002}) for i in range(8)]
        wait_running(engine, 8)
        os.kill(engine.replica_status()[0].pids[1], signal.SIGKILL)
        killed = time.monotonic()
        for f in futures:
            with pytest.raises(EngineUnavailableError):
                f.result(timeout=30)
        assert time.monotonic() - killed < 10.0
        assert not engine.replica_status()[0].healthy
        with pytest.raises(EngineUnavailableError):
            engine.submit({"prompts": [[1]], "max_tokens": 2})
    finally:
        engine.close()
    assert ray_probe.replica_status()[0].healthy  # the other group never noticed


def test_a_slow_gather_holds_no_lock_that_status_or_submit_need(inline_probe):
    """Entry.gather is plugin code: while it runs, replica_status, batch_stats and submit answer at once."""
    from tests.plugins.iterating import GATHERING

    GATHERING.clear()
    slow = inline_probe.submit({"prompts": [[1, 2]], "max_tokens": 2, "gather_s": 1.5})
    assert GATHERING.wait(10)
    started = time.monotonic()
    inline_probe.replica_status()
    inline_probe.batch_stats()
    other = inline_probe.submit({"prompts": [[3]], "max_tokens": 2})
    assert time.monotonic() - started < 0.5, "the loop's lock was held while the plugin gathered"
    assert slow.result(timeout=30)[0].token_ids == expected_tokens([1, 2], 2)
    assert other.result(timeout=30)[0].token_ids == expected_tokens([3], 2)


def test_requests_that_leave_while_the_replica_is_held_leave_nothing_queued(inline_probe):
    """Paused: nothing plans, so requests cancelled meanwhile must not pile up in the waiting line."""
    loop = inline_probe._executors[0].queue
    inline_probe.pause(mode="keep")
    try:
        kept = inline_probe.submit({"prompts": [[7]], "max_tokens": 2})
        for _ in range(5000):
            assert inline_probe.submit({"prompts": [[1], [2]], "max_tokens": 2}).cancel()
        assert len(loop._waiting) <= 2 * 1 + 64 + 2, len(loop._waiting)
        assert inline_probe.replica_status()[0].queued == 1
    finally:
        inline_probe.resume()
    assert kept.result(timeout=30)[0].token_ids == expected_tokens([7], 2)


def test_an_unread_stream_never_holds_up_the_loop_and_stays_max_buffered_chunks_long(inline_probe):
    """Nobody reads until the request is done: its chunks fold into max_buffered ones, tokens in order."""
    future, reader = inline_probe.open_stream({"prompts": [[1, 2], [3]], "max_tokens": 20}, max_buffered=3)
    outputs = future.result(timeout=30)  # finished without a reader
    chunks, done = reader.read(1.0)
    assert done and len(chunks) <= 3, len(chunks)

    def tokens(b: int) -> list[int]:
        got = [c["token_ids"][b] for c in chunks if c["token_ids"][b] is not None]
        return [t for g in got for t in (g if isinstance(g, list) else [g])]
    assert [tokens(0), tokens(1)] == [o.token_ids for o in outputs] == [expected_tokens([1, 2], 20),
                                                                       expected_tokens([3], 20)]


def test_a_plugins_own_admission_policy_and_value_results_with_their_weight_version():
    """`iter_groups` admits at most one group (prompt length) and 6 prompt ids per iteration, and ends
    each sequence with a value: the result carries the version of the weights that made it."""
    from tests.plugins.iterating import IterGroupsEntry

    args = EngineArgs(plugin=f"{IterGroupsEntry.__module__}:IterGroupsEntry", config=EngineConfig(device=CPU))
    with Engine(args, DeploymentConfig(batching=BatchingConfig(max_num_seqs=8))) as engine:
        sender = WeightSender("object_store")
        sender.init_transfer(engine)
        assert [r.error for r in sender.update(engine, [("scale", torch.full((1,), 2.0))], version=3)] == [None]
        engine.pause(mode="keep")  # everything below waits, then competes for the first iterations
        futures = [engine.submit({"prompts": [[1, 2]] * 2, "max_tokens": 3}),
                   engine.submit({"prompts": [[4, 5], [6, 7]], "max_tokens": 2}),
                   engine.submit({"prompts": [[1, 2, 3]], "max_tokens": 2}),
                   engine.submit({"prompts": [[9] * 8], "max_tokens": 1})]  # over the budget: runs alone
        engine.resume()
        results = [f.result(timeout=30) for f in futures]
        assert results[0] == [{"scale": 2, "made": 3}] * 2 and results[3] == [{"scale": 2, "made": 1}]
        assert [f.weight_version for f in futures] == [3] * 4
        ran = [g for g in engine.collective_rpc("ran")[0] if g]
        assert all(len(set(g)) == 1 for g in ran), ran  # one group per iteration
        assert all(len(g) == 1 or sum(g) <= 6 for g in ran), ran  # the cost budget, every iteration
        assert ran[0] == [2, 2, 2] and [3] in ran, ran  # two requests' sequences of one group shared an iteration


def test_each_iteration_reports_its_host_work_apart_from_its_forward(probe):
    """Inline and on a Ray TP=2 group: the forward (iter_probe's iterate(), which sleeps 10 ms here) is apart
    from the host parts, and the Ray group's round trip has a transport part (executors/loop_timing.py)."""
    def slow_forwards() -> int:  # iterations whose forward took over 10 ms (the histogram's le=0.01 bucket)
        snap = probe.batch_stats()[0]["iteration_forward_seconds"]
        return snap["count"] - next(count for bound, count in snap["buckets"] if bound == 0.01)

    before = slow_forwards()
    probe.step({"prompts": [[1, 2]], "max_tokens": 5, "sleep": 0.01})
    assert slow_forwards() >= before + 5  # each of its 5 iterations: the sleep counted as the forward
    stats = probe.batch_stats()[0]
    assert set(stats["iteration_parts_ms"]) == {"loop", "transport", "rank_plan", "rank_host", "forward"}
    assert 0 < stats["iteration_host_share"] < 1
    if probe.mode == "local":
        assert stats["iteration_parts_ms"]["transport"] > 0.0  # the plan to the ranks and the deltas back
