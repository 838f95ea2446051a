"""`lerobot_policy`: the frames admitted in one plan run their prefixes as ONE batched VLM pass.

Run: `.venv/bin/python -m pytest tests/test_lerobot_policy_batched.py -q` (inline, no Ray, no LeRobot).

The frames of tests/data/lerobot/<policy>/ carry prompts of different lengths (and pi0.5's prompts
hold the state, so theirs differ too): the batched pass pads them on the right and masks the padding.
Shown per policy type: the per-frame caches from one pass equal each frame's own pass; N robots
admitted together equal LeRobot's chunks and the per-frame path's, with and without RTC; the pass
really is one (counted); a frame rebuilt or dropped while others run; each prefix written once into a
slot of the rank's pool and read there while robots join and leave; the switch that turns batching off.
"""

from __future__ import annotations

from concurrent.futures import wait
from types import SimpleNamespace

import pytest
import torch

from phyai_ray import Engine, EngineArgs
from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry
from phyai_ray.models.lerobot_policy.policy import LeRobotPolicy
from tests.test_lerobot_policy import POLICIES, Cases, args_of
from tests.tolerances import against

CPU = SimpleNamespace(device="cpu")
TOL = against("lerobot", "chunks")


@pytest.fixture(scope="module", params=POLICIES)
def setup(request):
    entry = LeRobotPolicyEntry(args_of(request.param))
    return entry, entry.create({}, CPU), LeRobotPolicy(entry.folder, CPU, batch_prefixes=False), Cases(request.param)


def run_plan(model: LeRobotPolicy, payloads: dict[int, dict], limit: int = 100) -> dict[int, torch.Tensor]:
    """Admit every payload, then iterate until each frame has its chunk (at most `limit` iterations)."""
    for ident, payload in payloads.items():
        model.admit(ident, payload)
    out: dict[int, torch.Tensor] = {}
    for _ in range(limit):
        out.update({i: d.value["actions"] for i, d in model.iterate().items()})
        if len(out) == len(payloads):
            return out
    raise AssertionError(f"only {sorted(out)} of {sorted(payloads)} finished within {limit} iterations")


def test_one_pass_gives_each_frames_own_prefix_cache(setup):
    entry, model, _, cases = setup
    payloads = [entry.validate_request(cases.frame(i)) for i in range(cases.n)]
    together = model.encode(payloads)
    lengths = [f.prefix.length for f in together]
    assert len(set(lengths)) > 1, f"the reference prompts should differ in length, got {lengths}"
    for payload, batched in zip(payloads, together):
        [alone] = model.encode([payload])
        assert batched.prefix.length == alone.prefix.length
        for kind in ("keys", "values"):
            for got, want in zip(getattr(batched.prefix, kind), getattr(alone.prefix, kind), strict=True):
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, **TOL)
        for layer, pair in getattr(alone.prefix, "cross", {}).items():  # SmolVLA's projected cross-attention K/V
            for got, want in zip(batched.prefix.cross[layer], pair, strict=True):
                torch.testing.assert_close(got, want, **TOL)


def test_robots_admitted_together_run_one_prefix_pass_and_equal_lerobot(setup):
    entry, model, per_frame, cases = setup
    plain = {i: entry.validate_request(cases.frame(i)) for i in range(cases.n)}
    rtc = {cases.n + i: entry.validate_request(cases.frame(i, rtc=True)) for i in range(cases.n)}
    before, before_per_frame = model.prefix_stats(), per_frame.prefix_stats()
    got, reference = run_plan(model, {**plain, **rtc}), run_plan(per_frame, {**plain, **rtc})
    assert model.prefix_stats().get(2 * cases.n, 0) == before.get(2 * cases.n, 0) + 1  # ONE pass of all frames
    assert sum(model.prefix_stats().values()) == sum(before.values()) + 1
    assert per_frame.prefix_stats().get(1, 0) == before_per_frame.get(1, 0) + 2 * cases.n  # one pass each
    for i in range(cases.n):
        torch.testing.assert_close(got[i], cases.t["alone"][i], **TOL)
        torch.testing.assert_close(got[cases.n + i], cases.t["rtc"][i], **TOL)
    for ident, actions in got.items():
        torch.testing.assert_close(actions, reference[ident], **TOL)


def test_a_frame_rebuilt_or_dropped_while_others_run(setup):
    entry, model, _, cases = setup
    payloads = {i: entry.validate_request(cases.frame(i)) for i in range(cases.n)}
    for ident, payload in payloads.items():
        model.admit(ident, payload)
    model.iterate()
    model.iterate()
    model.recompute(0)  # from its noise again, its prefix encoded anew at the next iteration
    model.admit(7, payloads[1])
    model.drop(7)  # dropped before its prefix ran: it never runs
    done: dict[int, torch.Tensor] = {}
    for _ in range(30):
        done.update({i: d.value["actions"] for i, d in model.iterate().items()})
    assert sorted(done) == list(range(cases.n))
    assert not model.running
    for i in range(cases.n):
        torch.testing.assert_close(done[i], cases.t["alone"][i], **TOL)


def test_each_prefix_is_written_once_into_a_slot_and_read_in_place_while_others_join_and_leave(setup):
    entry, model, _, cases = setup
    payloads = [entry.validate_request(cases.frame(i)) for i in range(cases.n)]
    done: dict[int, torch.Tensor] = {}
    where: dict[int, tuple[int, int]] = {}  # ident -> (its slot, where its first layer's keys live)
    for step in range(40):
        if step < cases.n:
            model.admit(step, payloads[step])  # a robot joins at each of the first iterations
        if 0 in done and cases.n not in done and cases.n not in model.running:
            model.admit(cases.n, payloads[0])  # a late robot, after the first one left
        done.update({i: d.value["actions"] for i, d in model.iterate().items()})
        pool = model.slots.pools.get(("k", 0))
        for ident in model.running:
            frame = model.running[ident]
            if frame.slot is None:
                continue
            keys = frame.prefix.keys[0]
            assert keys.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()  # a view of its slot
            assert where.setdefault(ident, (frame.slot, keys.data_ptr())) == (frame.slot, keys.data_ptr())
        if len(done) == cases.n + 1:
            break
    assert sorted(done) == list(range(cases.n + 1))
    for i in range(cases.n):
        torch.testing.assert_close(done[i], cases.t["alone"][i], **TOL)
    torch.testing.assert_close(done[cases.n], cases.t["alone"][0], **TOL)
    assert where[cases.n][0] == 0  # the first robot's slot went back to the pool with its chunk
    assert model.slots.pools == {} and model.slots.held_bytes() == 0  # nothing held while idle


@pytest.mark.parametrize("policy", POLICIES[:2])
def test_frames_of_one_plan_share_a_prefix_pass_in_the_engine(policy):
    cases = Cases(policy)
    with Engine(EngineArgs(plugin="lerobot_policy", plugin_args=args_of(policy))) as engine:
        engine.pause(mode="keep")
        futures = [engine.submit(cases.frame(i)) for i in range(cases.n)]
        engine.resume()
        wait(futures, timeout=120)
        for i, future in enumerate(futures):
            torch.testing.assert_close(future.result(timeout=1)["actions"], cases.t["alone"][i], **TOL)
        [stats] = engine.collective_rpc("prefix_stats", timeout=30)
    assert stats == {cases.n: 1}, f"the {cases.n} frames of one plan should share one prefix pass, got {stats}"


def test_the_switch_runs_each_prefix_alone_and_refuses_a_non_bool():
    entry = LeRobotPolicyEntry({**args_of(POLICIES[0]), "batch_prefixes": False})
    model = entry.create({}, CPU)
    cases = Cases(POLICIES[0])
    got = run_plan(model, {i: entry.validate_request(cases.frame(i)) for i in range(cases.n)})
    assert model.prefix_stats() == {1: cases.n}
    for i in range(cases.n):
        torch.testing.assert_close(got[i], cases.t["alone"][i], **TOL)
    with pytest.raises(ValueError, match="batch_prefixes"):
        LeRobotPolicyEntry({**args_of(POLICIES[0]), "batch_prefixes": "no"})


def test_cameras_of_different_sizes_go_through_the_tower_by_size_in_order():
    from phyai_ray.models.lerobot_policy.layers import by_shape

    images = [torch.full((3, 4, 4), 0.0), torch.full((3, 2, 6), 1.0), torch.full((3, 4, 4), 2.0)]
    calls = []

    def tower(pixels: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(pixels.shape))
        return pixels.flatten(1).mean(1, keepdim=True)

    rows = by_shape(images, tower)
    assert sorted(calls) == [(1, 3, 2, 6), (2, 3, 4, 4)]  # one call per size, the two 4 x 4 images together
    assert [float(r) for r in rows] == [0.0, 1.0, 2.0]  # each image's row back in its place
