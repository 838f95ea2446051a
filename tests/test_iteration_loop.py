"""`IterationLoop` as a part: built from its collaborators alone, with a fake replica side (no engine, no ranks).

Run: .venv/bin/pytest tests/test_iteration_loop.py -q

`FakeRanks.run_iteration` applies each plan to its own running sequences and advances each one
denoising-style step (a value at the end, no tokens), so these tests see what the plugin's
admission policy let into every iteration: at most one latent shape at a time and the cost budget
counted for every running sequence; value results carry the weight version they were made under;
a request that ends leaves the deadline heap at once; a loop that breaks calls `on_failure`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from phyai_ray import BatchingConfig, Entry, EngineUnavailableError
from phyai_ray.executors.futures import CallbackThread
from phyai_ray.executors.iterations import IterationLoop
from phyai_ray.plugins.admission import CostBudget, GroupLimit
from phyai_ray.plugins.iteration import Delta, IterationPlan, SequenceSpec

BUDGET = 100


class ShapesEntry(Entry):
    """A diffusion-like plugin: one sequence per latent, cost = its latent tokens, group = its shape."""

    name = "shapes"

    def sequences(self, request: dict) -> list[SequenceSpec]:
        return [SequenceSpec({"steps": request["steps"], "shape": shape, "cost": cost}, cost=cost, group=shape)
                for shape, cost in request["latents"]]

    def admission(self, batching: BatchingConfig) -> GroupLimit:
        return GroupLimit(CostBudget(batching.max_num_seqs, BUDGET), max_groups=1)


class FakeRanks:
    """The loop's pipeline: runs each plan at once and remembers who ran in every iteration."""

    def __init__(self, version: object = None) -> None:
        self.version = version
        self.running: dict[int, dict] = {}
        self.iterations: list[list[dict]] = []  # the payloads that ran in each iteration
        self.sizes: list[int] = []
        self.failures: list[BaseException] = []

    def run_iteration(self, plan: IterationPlan) -> Future:
        for ident in plan.drop:
            self.running.pop(ident, None)
        for ident, payload in plan.admit:
            self.running[ident] = {**payload, "made": 0}
        self.iterations.append([dict(s) for s in self.running.values()])
        deltas = {}
        for ident, seq in list(self.running.items()):
            seq["made"] += 1
            if seq["made"] < seq["steps"]:
                deltas[ident] = Delta()
            else:
                deltas[ident] = Delta(stop_reason="completed", value={"shape": seq["shape"], "steps": seq["made"]})
                del self.running[ident]
        future: Future = Future()
        future.weight_version = self.version
        future.set_result(deltas)
        return future

    def record(self, size: int, waits: list[float]) -> None:
        self.sizes.append(size)


def make_loop(ranks: FakeRanks, entry: Entry | None = None, **batching) -> IterationLoop:
    loop = IterationLoop(0, entry or ShapesEntry(), BatchingConfig(**batching), pipeline=ranks,
                         delivery=CallbackThread("test-loop-callbacks"),
                         on_failure=lambda error: ranks.failures.append(error), limit_s=30.0, max_queued=None)
    return loop


def test_the_plugins_policy_decides_every_iteration_and_values_carry_their_weight_version():
    ranks = FakeRanks(version=5)
    loop = make_loop(ranks, max_num_seqs=8)
    loop.quiesce("pause", "keep", time.monotonic() + 5)  # held: everything below waits, then competes
    requests = [{"steps": 3, "latents": [((16, 16), 30), ((16, 16), 30)]},
                {"steps": 2, "latents": [((32, 32), 60)]},
                {"steps": 4, "latents": [((16, 16), 40)]},
                {"steps": 1, "latents": [((8, 8), 150)]}]  # over the budget: runs alone
    futures = [loop.submit(r) for r in requests]
    loop.release(None)
    results = [f.result(timeout=10) for f in futures]
    assert results[0] == [{"shape": (16, 16), "steps": 3}] * 2 and results[3] == [{"shape": (8, 8), "steps": 1}]
    assert all(f.weight_version == 5 for f in futures), [f.weight_version for f in futures]
    for ran in ranks.iterations:
        assert len({s["shape"] for s in ran}) == 1, ran  # GroupLimit(max_groups=1)
        assert len(ran) == 1 or sum(s["cost"] for s in ran) <= BUDGET, ran  # CostBudget, every iteration
    assert max(len(ran) for ran in ranks.iterations) == 2, "the two same-shape latents shared iterations"
    assert ranks.sizes and ranks.failures == []
    assert loop.counts().served == 4 and loop.counts().in_flight == 0


def test_a_request_that_ends_leaves_the_deadline_heap_at_once():
    ranks = FakeRanks()
    loop = make_loop(ranks)
    far = time.monotonic() + 3600
    futures = [loop.submit({"steps": 2, "latents": [((4, 4), 1)]}, deadline=far) for _ in range(200)]
    assert all(f.result(timeout=10) for f in futures)
    assert len(loop._deadlines) == 0 and len(loop._deadlines._heap) <= 64, len(loop._deadlines._heap)
    assert futures[0].deadline == far


def test_a_request_past_its_own_deadline_without_a_slot_never_runs():
    from phyai_ray import DeadlineMissedError

    ranks = FakeRanks()
    loop = make_loop(ranks)
    loop.quiesce("pause", "keep", time.monotonic() + 5)
    late = loop.submit({"steps": 1, "latents": [((4, 4), 1)]}, deadline=time.monotonic() + 0.05)
    with pytest.raises(DeadlineMissedError):
        late.result(timeout=10)
    loop.release(None)
    assert ranks.iterations == [] and len(loop._deadlines) == 0


def test_a_broken_policy_stops_the_loop_through_on_failure():
    class Broken(ShapesEntry):
        def admission(self, batching):
            return BrokenPolicy()

    class BrokenPolicy:
        def begin(self, running) -> None:
            pass

        def admit(self, candidate) -> bool:
            raise RuntimeError("policy bug")

    ranks = FakeRanks()
    loop = make_loop(ranks, Broken())
    stopped = threading.Event()
    ranks.failures = FailureList(loop, stopped)
    future = loop.submit({"steps": 1, "latents": [((4, 4), 1)]})
    assert stopped.wait(10)
    [error] = ranks.failures
    assert isinstance(error, EngineUnavailableError) and "policy bug" in str(error)
    with pytest.raises(EngineUnavailableError):
        future.result(timeout=10)


class FailureList(list):
    """on_failure as a replica does it: record, then stop the loop (fail what it holds)."""

    def __init__(self, loop: IterationLoop, stopped: threading.Event) -> None:
        super().__init__()
        self.loop, self.stopped = loop, stopped

    def append(self, error: BaseException) -> None:
        super().append(error)
        self.loop.stop(lambda: EngineUnavailableError("replica 0 stopped", reason="exception", replica=0))
        self.stopped.set()


def test_an_admission_that_is_no_policy_is_refused_naming_the_plugin():
    class NoPolicy(ShapesEntry):
        def admission(self, batching):
            return 64

    with pytest.raises(TypeError, match="plugin shapes: admission\\(batching\\) must return a policy"):
        make_loop(FakeRanks(), NoPolicy())
