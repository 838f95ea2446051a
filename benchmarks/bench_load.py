"""Open-loop load: Poisson arrivals at 50%, 90% and 120% of capacity, phyai-ray vs bare Ray actors.

Run: `.venv/bin/python benchmarks/bench_load.py [--seconds 8] [--replicas 2] [--step-ms 10]`

Both sides serve the same plugin (sleep `step_ms`) on `replicas` single-rank replicas, fed by
the same arrival schedule. phyai-ray routes each request to the replica with the fewest in flight,
keeps at most `max_ongoing_requests` at the ranks, queues up to `max_queued_requests` per replica
and sheds the rest at once (`EngineOverloadedError`); a request unfinished after
`execution_timeout_s` fails alone (`RequestTimeoutError`). Bare Ray actors are fed round robin and
queue without bound, so past capacity their latency grows for as long as the overload lasts.
Prints, per load: offered and served rate, p50 / p99 latency of served requests, shed and
timed-out counts, and the latency ratio phyai-ray / bare Ray; then the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import threading
import time
from typing import Any, Callable

import ray

import results  # noqa: E402  (benchmarks/results.py, beside this script)
from phyai_ray import (DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig, EngineOverloadedError, Entry,
                       RequestTimeoutError, WorkerSupervisorConfig)


class Sleeper:
    def __init__(self, plugin_args: dict, ctx: Any) -> None:
        self.step_s = float(plugin_args["step_s"])

    def step(self, request: Any) -> Any:
        time.sleep(self.step_s)
        return request


class SleeperEntry(Entry):
    name = "bench_sleeper"

    def create(self, plugin_args: dict, ctx: Any) -> Sleeper:
        return Sleeper(plugin_args, ctx)


@ray.remote(num_cpus=1)
class BareSleeper:
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def step(self, request: Any) -> Any:
        time.sleep(self.step_s)
        return request


class Tally:
    """Latencies of served requests and counts of the other outcomes, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.shed = self.timed_out = self.failed = 0

    def done(self, started: float, error: BaseException | None) -> None:
        with self.lock:
            if error is None:
                self.latencies.append(time.perf_counter() - started)
            elif isinstance(error, RequestTimeoutError):
                self.timed_out += 1
            else:
                self.failed += 1


def arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    """Poisson arrival offsets (s) at `rate` per second over `seconds`."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)


def drive(schedule: list[float], send: Callable[[Tally, float], None], drain_s: float) -> tuple[Tally, float]:
    """Send at each offset of `schedule` (open loop: never waits for replies); then wait for the tail.

    Returns the tally and the time from the first send to the last outcome (served rates use it).
    """
    tally = Tally()
    start = time.perf_counter()
    for offset in schedule:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        send(tally, time.perf_counter())
    deadline = time.perf_counter() + drain_s
    while time.perf_counter() < deadline:
        with tally.lock:
            if len(tally.latencies) + tally.shed + tally.timed_out + tally.failed >= len(schedule):
                break
        time.sleep(0.01)
    return tally, time.perf_counter() - start


def engine_sender(engine: Engine) -> Callable[[Tally, float], None]:
    def send(tally: Tally, started: float) -> None:
        try:
            future = engine.submit(0)
        except EngineOverloadedError:
            with tally.lock:
                tally.shed += 1
            return
        future.add_done_callback(lambda f: tally.done(started, f.exception()))
    return send


def bare_sender(actors: list) -> Callable[[Tally, float], None]:
    turn = [0]

    def send(tally: Tally, started: float) -> None:
        actor = actors[turn[0] % len(actors)]
        turn[0] += 1
        actor.step.remote(0).future().add_done_callback(lambda f: tally.done(started, f.exception()))
    return send


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, load: float, offered: float, tally: Tally, seconds: float) -> dict:
    served = len(tally.latencies)
    return {"name": name, "load": load, "offered": offered, "served_rate": served / seconds,
            "p50": statistics.median(tally.latencies) if served else float("nan"),
            "p99": pct(tally.latencies, 0.99), "shed": tally.shed, "timed_out": tally.timed_out,
            "failed": tally.failed, "served": served}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--max-queued", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=1.0)
    results.add_flag(parser)
    opts = parser.parse_args()
    step_s, n = opts.step_ms / 1000, opts.replicas
    capacity = n / step_s
    ray.init(num_cpus=max(8, 2 * n), include_dashboard=False, log_to_driver=False)
    proc = WorkerSupervisorConfig(execution_timeout_s=opts.timeout_s, max_queued_requests=opts.max_queued)
    args = EngineArgs(plugin=SleeperEntry, plugin_args={"step_s": step_s},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    rows = []
    with Engine(args, DeploymentConfig(mode="local", replica_count=n, process_config=proc)) as engine:
        bare = [BareSleeper.remote(step_s) for _ in range(n)]
        ray.get([a.step.remote(0) for a in bare], timeout=60)
        for f in [engine.submit(0) for _ in range(n * 4)]:
            f.result(timeout=60)
        for load in (0.5, 0.9, 1.2):
            schedule = arrivals(load * capacity, opts.seconds, seed=int(load * 100))
            for name, send in (("phyai-ray", engine_sender(engine)), ("bare Ray", bare_sender(bare))):
                tally, elapsed = drive(schedule, send, drain_s=opts.seconds * 3)
                rows.append(row(name, load, len(schedule) / opts.seconds, tally, elapsed))
                time.sleep(0.5)
        for actor in bare:
            ray.kill(actor)
    report(rows, capacity, opts, n)
    for r in rows:
        results.record("load", side=r["name"], load=r["load"], offered=r["offered"], served=r["served_rate"],
                       p50_ms=r["p50"] * 1e3, p99_ms=r["p99"] * 1e3, shed=r["shed"])
    results.write(opts.json, "load", f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPU(s), "
                  f"Python {platform.python_version()}, Ray {ray.__version__}")
    ray.shutdown()


def report(rows: list[dict], capacity: float, opts: Any, n: int) -> None:
    print(f"\nopen-loop load: {n} replica(s) x {opts.step_ms:.0f} ms step, capacity {capacity:.0f} req/s, "
          f"{opts.seconds:.0f} s per load, phyai-ray max_queued_requests={opts.max_queued} per replica, "
          f"execution_timeout_s={opts.timeout_s}")
    print(f"{'load':>5} {'side':<10} {'offered/s':>9} {'served/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'shed':>6} {'timeout':>7} {'p50 x':>6} {'p99 x':>6}")
    for ours, bare in zip(rows[::2], rows[1::2]):
        for r in (ours, bare):
            ratio = (f"{ours['p50'] / bare['p50']:>6.2f} {ours['p99'] / bare['p99']:>6.2f}" if r is ours else "")
            print(f"{r['load']:>5.0%} {r['name']:<10} {r['offered']:>9.0f} {r['served_rate']:>9.0f} "
                  f"{r['p50'] * 1e3:>8.1f} {r['p99'] * 1e3:>8.1f} {r['shed']:>6} {r['timed_out']:>7} {ratio}")
    print(f"(x: phyai-ray latency / bare Ray latency at the same arrivals)\nmachine: {platform.node()} "
          f"{platform.machine()}, {os.cpu_count()} CPU(s), {platform.python_version()}, Ray {ray.__version__}")


if __name__ == "__main__":
    main()
