"""Step latency and throughput of phyai-ray against the bare baselines, measured side by side.

Run: `.venv/bin/python benchmarks/bench_engine.py [--requests 300] [--max-replicas 4]`

1. Inline engine vs calling the plugin's step() directly (no-op plugin).
2. One 2-rank Ray replica vs a bare pair of Ray actors receiving the same `ray.put` reference.
3. Throughput of N = 1..max replicas of a 10 ms sleep plugin vs N bare Ray actors fed round robin.
Prints median and p99 of each and the ratio (phyai-ray / baseline), plus the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any, Callable

import ray
import torch

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       Entry, ParallelConfig)


class Noop:
    def __init__(self, plugin_args: dict, ctx: Any) -> None:
        self.sleep_s = float(plugin_args.get("sleep_s", 0.0))

    def step(self, request: Any) -> Any:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return request


class NoopEntry(Entry):
    name = "bench_noop"
    parallel_domains = frozenset({"dense"})

    def create(self, plugin_args: dict, ctx: Any) -> Noop:
        return Noop(plugin_args, ctx)


@ray.remote(num_cpus=1)
class BareActor:
    def __init__(self, sleep_s: float = 0.0) -> None:
        self.sleep_s = sleep_s

    def step(self, request: Any) -> Any:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return request


def args(tp: int = 1, sleep_s: float = 0.0) -> EngineArgs:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp)) if tp > 1 else ParallelConfig()
    return EngineArgs(plugin=NoopEntry, plugin_args={"sleep_s": sleep_s},
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))


def bare_step(actors: list, request: Any) -> list:
    """The baseline request path: one `ray.put`, the same reference to every actor."""
    ref = ray.put(request)
    return ray.get([a.step.remote(ref) for a in actors], timeout=60)


def latencies(fn: Callable[[], Any], n: int, warmup: int = 10) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, ours: list[float], base: list[float]) -> str:
    m_o, m_b = statistics.median(ours), statistics.median(base)
    p_o, p_b = p(ours, 0.99), p(base, 0.99)
    return (f"{name:<34} {m_o * 1e6:>10.1f} {m_b * 1e6:>10.1f} {m_o / m_b:>7.2f}x "
            f"{p_o * 1e6:>10.1f} {p_b * 1e6:>10.1f} {p_o / p_b:>7.2f}x")


def bench_latency(n: int) -> list[str]:
    request = {"x": torch.zeros(16)}
    lines = []
    with Engine(args()) as engine:
        direct = engine._executors[0]._runner.model
        lines.append(row("inline step vs direct call", latencies(lambda: engine.step(request), n),
                         latencies(lambda: direct.step(request), n)))
    with Engine(args(tp=2), DeploymentConfig.local()) as engine:
        ours = latencies(lambda: engine.step(request), n)
    pair = [BareActor.remote() for _ in range(2)]
    base = latencies(lambda: bare_step(pair, request), n)
    for actor in pair:
        ray.kill(actor)
    lines.append(row("2-rank replica vs bare 2-actor put", ours, base))
    return lines


def throughput(submit: Callable[[], Any], wait_all: Callable[[list], Any], n: int) -> float:
    start = time.perf_counter()
    wait_all([submit() for _ in range(n)])
    return n / (time.perf_counter() - start)


def bench_throughput(max_replicas: int, n: int, sleep_s: float = 0.01) -> list[str]:
    lines = []
    for replicas in range(1, max_replicas + 1):
        with Engine(args(sleep_s=sleep_s), DeploymentConfig(mode="local", replica_count=replicas)) as engine:
            engine.step({})
            ours = throughput(lambda: engine.submit({}), lambda fs: [f.result(60) for f in fs], n)
        actors = [BareActor.remote(sleep_s) for _ in range(replicas)]
        ray.get([a.step.remote({}) for a in actors], timeout=120)
        turn = iter(range(10 ** 9))
        base = throughput(lambda: actors[next(turn) % replicas].step.remote({}),
                          lambda refs: ray.get(refs, timeout=120), n)
        for actor in actors:
            ray.kill(actor)
        ideal = replicas / sleep_s
        lines.append(f"{replicas} replica(s) x 10 ms sleep          {ours:>8.1f} req/s  bare {base:>8.1f} req/s  "
                     f"ratio {ours / base:>5.2f}x  (ideal {ideal:.0f} req/s)")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-replicas", type=int, default=4)
    opts = parser.parse_args(argv)
    ray.init(num_cpus=max(8, 2 * opts.max_replicas), include_dashboard=False, log_to_driver=False)
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpu(s), python "
          f"{platform.python_version()}, torch {torch.__version__}, ray {ray.__version__}")
    print(f"{'latency (us)':<34} {'ours p50':>10} {'base p50':>10} {'ratio':>8} {'ours p99':>10} "
          f"{'base p99':>10} {'ratio':>8}")
    for line in bench_latency(opts.requests):
        print(line)
    print("throughput")
    for line in bench_throughput(opts.max_replicas, opts.requests):
        print(line)
    ray.shutdown()


if __name__ == "__main__":
    main()
