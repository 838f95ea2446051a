"""Step latency, throughput and large tensors of phyai-ray against bare baselines, side by side in one run.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_engine.py [--requests 300] [--max-replicas 4]`
(`--only inline`: part 1 alone, without Ray)

1. Inline `Engine.step` and `submit().result()` vs calling the plugin's step() directly: a no-op and a
   200 us busy loop.
2. One 2-rank Ray replica (no-op step; the default same-node socket lane, the compiled-graph lane and actor
   calls) vs a bare `ray.put` + 2-actor broadcast + `ray.get`, and vs the Ray Compiled Graph floor: two
   actors receiving the same request.
3. Throughput of N = 1..max replicas of a 10 ms sleep plugin vs the ideal N x 100 req/s.
4. A 64 MB CPU tensor: as a result (vs a bare `ray.get` of it from an actor) and as a request to a
   TP=2 replica (vs a bare `ray.put` + 2-actor broadcast).
Prints median and p99, each ratio with its target, and the machine it ran on.
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
from ray.dag import InputNode, MultiOutputNode

from phyai_ray import (DenseParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       Entry, ParallelConfig, WorkerSupervisorConfig)

BIG = 64 * 2 ** 20 // 4  # float32 elements of a 64 MB tensor
REQUEST = {"x": torch.zeros(16)}


class Noop:
    """Returns the request (or a stored 64 MB tensor); sleeps or busy-waits when asked."""

    def __init__(self, plugin_args: dict, ctx: Any) -> None:
        self.sleep_s = float(plugin_args.get("sleep_s", 0.0))
        self.busy_s = float(plugin_args.get("busy_s", 0.0))
        self.big = torch.ones(BIG) if plugin_args.get("big_result") else None

    def step(self, request: Any) -> Any:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.busy_s:
            end = time.perf_counter() + self.busy_s
            while time.perf_counter() < end:
                pass
        if self.big is not None:
            return self.big
        if isinstance(request, dict) and "big" in request:
            return float(request["big"][0])
        return request


class NoopEntry(Entry):
    name = "bench_noop"
    parallel_domains = frozenset({"dense"})

    def create(self, plugin_args: dict, ctx: Any) -> Noop:
        return Noop(plugin_args, ctx)


@ray.remote(num_cpus=1)
class BareActor:
    def __init__(self, big_result: bool = False) -> None:
        self.big = torch.ones(BIG) if big_result else None

    def step(self, request: Any) -> Any:
        if self.big is not None:
            return self.big
        if isinstance(request, dict) and "big" in request:
            return float(request["big"][0])
        return request


def args(tp: int = 1, **plugin_args: Any) -> EngineArgs:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp)) if tp > 1 else ParallelConfig()
    return EngineArgs(plugin=NoopEntry, plugin_args=plugin_args,
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))


def local(replicas: int = 1, transport: str = "auto") -> DeploymentConfig:
    return DeploymentConfig(mode="local", replica_count=replicas,
                            process_config=WorkerSupervisorConfig(request_transport=transport))


def latencies(fn: Callable[[], Any], n: int, warmup: int = 20) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def interleaved(fns: list[Callable[[], Any]], n: int, rounds: int = 20) -> list[list[float]]:
    """`latencies` of each of `fns`, `n` calls each, taken in `rounds` alternating blocks: a machine
    whose speed drifts (a shared VM's does, by 2x over seconds) slows every side alike."""
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, values in zip(fns, out):
            values += latencies(fn, max(1, n // rounds), warmup=5)
    return out


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def row(name: str, values: list[float]) -> str:
    return f"  {name:<44} p50 {statistics.median(values) * 1e6:>9.1f} us   p99 {p99(values) * 1e6:>9.1f} us"


def verdict(name: str, value: float, target: float, lower_is_better: bool = True, unit: str = "x") -> str:
    met = value <= target if lower_is_better else value >= target
    sign = "<=" if lower_is_better else ">="
    return f"  {name:<44} {value:>8.2f}{unit}  target {sign} {target}{unit}  {'met' if met else 'NOT MET'}"


def bench_inline(n: int) -> list[str]:
    lines = []
    for busy_s, label in ((0.0, "no-op"), (200e-6, "200 us busy")):
        with Engine(args(busy_s=busy_s)) as engine:
            replica = engine._executors[0]
            model = replica.ranks.model if hasattr(replica, "ranks") else replica._runner.model  # older trees
            direct, ours, handed = interleaved([lambda: model.step(REQUEST), lambda: engine.step(REQUEST),
                                                lambda: engine.submit(REQUEST).result()], 5 * n)
        lines += [row(f"direct model.step ({label})", direct), row(f"inline Engine.step ({label})", ours),
                  row(f"inline submit().result() ({label})", handed)]
        if busy_s:
            lines.append(verdict("inline 200 us step / direct (p50)", statistics.median(ours) / statistics.median(direct),
                                 1.05))
            lines.append(verdict("inline 200 us submit().result() / direct (p50)",
                                 statistics.median(handed) / statistics.median(direct), 1.3))
        else:
            overhead = (statistics.median(ours) - statistics.median(direct)) * 1e6
            lines.append(verdict("inline no-op overhead (p50)", overhead, 10, unit=" us"))
    return lines


def compiled_floor(actors: list, n: int) -> list[float]:
    """Ray Compiled Graph: the same request to two actors, both replies back."""
    with InputNode() as request:
        graph = MultiOutputNode([a.step.bind(request) for a in actors])
    dag = graph.experimental_compile()
    try:
        return latencies(lambda: ray.get(dag.execute(REQUEST)), n)
    finally:
        dag.teardown()


def bench_ray_latency(n: int) -> list[str]:
    pair = [BareActor.remote() for _ in range(2)]
    bare = latencies(lambda: ray.get([a.step.remote(ref) for ref in [ray.put(REQUEST)] for a in pair]), n)
    floor = compiled_floor(pair, n)
    for actor in pair:
        ray.kill(actor)
    ours = {}
    for transport in ("ipc", "compiled", "actor_calls"):
        with Engine(args(tp=2), local(transport=transport)) as engine:
            ours[transport] = latencies(lambda: engine.step(REQUEST), n)
    floor50, floor99 = statistics.median(floor), p99(floor)
    lines = [row("bare put + 2-actor broadcast + get", bare), row("Ray Compiled Graph 2-actor floor", floor),
             row("Engine TP=2 no-op step (ipc, the default)", ours["ipc"]),
             row("Engine TP=2 no-op step (compiled)", ours["compiled"]),
             row("Engine TP=2 no-op step (actor calls)", ours["actor_calls"]),
             verdict("default step / floor (p50)", statistics.median(ours["ipc"]) / floor50, 2),
             verdict("default step / floor (p99)", p99(ours["ipc"]) / floor99, 3)]
    for name, values, base, base99 in (("compiled step / floor", ours["compiled"], floor50, floor99),
                                       ("actor-call step / bare Ray", ours["actor_calls"], statistics.median(bare),
                                        p99(bare))):
        lines.append(f"  {name + ' (p50, p99; no target)':<44} {statistics.median(values) / base:>8.2f}x "
                     f"{p99(values) / base99:>6.2f}x")
    return lines


def bench_throughput(max_replicas: int, per_replica: int, sleep_s: float = 0.01) -> list[str]:
    lines = []
    for replicas in range(1, max_replicas + 1):
        with Engine(args(sleep_s=sleep_s), local(replicas)) as engine:
            for f in [engine.submit(REQUEST) for _ in range(2 * replicas)]:
                f.result(60)
            n = per_replica * replicas
            start = time.perf_counter()
            for f in [engine.submit(REQUEST) for _ in range(n)]:
                f.result(120)
            rate = n / (time.perf_counter() - start)
        ideal = replicas / sleep_s
        lines.append(verdict(f"{replicas} replica(s) x 10 ms: {rate:6.1f} req/s / ideal {ideal:.0f}", rate / ideal, 0.9,
                             lower_is_better=False))
    return lines


def bench_large(n: int) -> list[str]:
    actor = BareActor.remote(big_result=True)
    bare = latencies(lambda: ray.get(actor.step.remote(None)), n, warmup=2)
    ray.kill(actor)
    with Engine(args(big_result=True), local()) as engine:
        ours = latencies(lambda: engine.step({}), n, warmup=2)
    request = {"big": torch.ones(BIG)}
    pair = [BareActor.remote() for _ in range(2)]
    bare_in = latencies(lambda: ray.get([a.step.remote(ref) for ref in [ray.put(request)] for a in pair]), n, warmup=2)
    for a in pair:
        ray.kill(a)
    with Engine(args(tp=2), local()) as engine:
        ours_in = latencies(lambda: engine.step(request), n, warmup=2)
    return [row("bare ray.get of a 64 MB tensor from an actor", bare), row("Engine step returning 64 MB", ours),
            verdict("64 MB result speed / bare ray.get", statistics.median(bare) / statistics.median(ours), 0.8,
                    lower_is_better=False),
            row("bare put + 2-actor broadcast of 64 MB", bare_in), row("Engine TP=2 step with a 64 MB request", ours_in),
            verdict("64 MB request speed / bare broadcast", statistics.median(bare_in) / statistics.median(ours_in), 0.8,
                    lower_is_better=False)]


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return (f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpu(s), {mem:.0f} GiB, "
            f"{platform.processor() or platform.system()}; python {platform.python_version()}, "
            f"torch {torch.__version__}, ray {ray.__version__}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--large", type=int, default=8, help="repetitions of each 64 MB transfer")
    parser.add_argument("--only", choices=("inline",), default=None,
                        help="run only part 1 (inline Engine.step vs a direct call; no Ray started)")
    opts = parser.parse_args(argv)
    if opts.only == "inline":
        print(machine())
        print("inline")
        for line in bench_inline(opts.requests):
            print(line, flush=True)
        return
    ray.init(num_cpus=max(8, 2 * opts.max_replicas), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    print(machine())
    sections = [("inline", lambda: bench_inline(opts.requests)),
                ("Ray request path (2 ranks)", lambda: bench_ray_latency(opts.requests)),
                ("throughput", lambda: bench_throughput(opts.max_replicas, 100)),
                ("64 MB CPU tensors", lambda: bench_large(opts.large))]
    for title, run in sections:
        print(title)
        for line in run():
            print(line, flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
