"""HTTP latency and throughput of the phyai-ray Serve app against a bare Ray Serve FastAPI echo, side by side.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_http.py [--requests 300] [--seconds 6] [--clients 16]`

Every variant answers `POST /v1/step {"x": [[...8 floats...]]}` with the request echoed back:

    bare x1 / bare x2      a Serve FastAPI deployment that returns the JSON body (1 or 2 replicas)
    groups 2 x TP=1        phyai-ray, 2 groups, each rank inline in its Serve replica (proxy -> group)
    groups 1 x TP=2        phyai-ray, 1 group of 2 rank actors (proxy -> group -> ranks, gloo)
    gateway + 2 x TP=1     a FastAPI gateway deployment (2 replicas) calling the groups' handle:
                           the alternative edge design, measured to choose between them

Sequential p50/p99 (one client) and throughput (`--clients` concurrent clients for `--seconds`),
then the ratios against the bare echo (p50 vs bare x1, throughput vs bare x2 for 2 groups).
"""


import argparse
import os
import platform
import statistics
import threading
import time
from typing import Any, Callable

import ray
import requests
from fastapi import FastAPI, Request
from ray import serve

from phyai_ray import DenseParallelConfig, DeploymentConfig, DeviceConfig, EngineArgs, EngineConfig, Entry, ParallelConfig

BODY = {"x": [[1.0] * 8]}


class Echo:
    def __init__(self, plugin_args: dict, ctx: Any) -> None:
        pass

    def step(self, request: Any) -> Any:
        return request


class EchoEntry(Entry):
    name = "bench_echo"
    parallel_domains = frozenset({"dense"})

    def create(self, plugin_args: dict, ctx: Any) -> Echo:
        return Echo(plugin_args, ctx)


bare_api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(bare_api)
class BareEcho:
    @bare_api.post("/v1/step")
    async def step(self, request: Request) -> dict:
        return {"result": await request.json()}


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Gateway:
    """A plain HTTP deployment (an app may hold one FastAPI ingress only: the groups are one)."""

    def __init__(self, groups: Any) -> None:
        self.groups = groups

    async def __call__(self, request: Request) -> dict:
        return {"result": await self.groups.step.remote(await request.json())}


def engine_args(tp: int) -> EngineArgs:
    return EngineArgs(plugin=EchoEntry, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=tp))))


def phyai_app(tp: int, groups: int) -> Any:
    from phyai_ray.serve import create_app

    return create_app(engine_args(tp), DeploymentConfig(replica_count=groups, cpus_per_rank=0.5))


def gateway_app() -> Any:
    from phyai_ray.serve.runtime.app import group_options
    from phyai_ray.serve.runtime.group import ReplicaGroup
    from phyai_ray.serve.runtime.options import ServeOptions
    from phyai_ray.serve.runtime.registry import GroupRegistry

    args, deployment, options = engine_args(1), DeploymentConfig(replica_count=2, cpus_per_rank=0.5), ServeOptions()
    registry = serve.deployment(GroupRegistry, name="GroupRegistry", ray_actor_options={"num_cpus": 0}).bind()
    groups = serve.deployment(ReplicaGroup, name="ReplicaGroup", **group_options(args, deployment, options))
    return Gateway.options(num_replicas=2).bind(groups.bind(args, deployment, options, registry))


VARIANTS: dict[str, Callable[[], Any]] = {
    "bare x1": lambda: BareEcho.options(num_replicas=1).bind(),
    "bare x2": lambda: BareEcho.options(num_replicas=2).bind(),
    "groups 2 x TP=1": lambda: phyai_app(1, 2),
    "groups 1 x TP=2": lambda: phyai_app(2, 1),
    "gateway + 2 x TP=1": gateway_app,
}


def sequential(url: str, count: int) -> tuple[float, float]:
    """p50 and p99 latency in ms of `count` requests one after another."""
    with requests.Session() as session:
        for _ in range(20):  # warm-up
            session.post(url, json=BODY, timeout=30).raise_for_status()
        times = []
        for _ in range(count):
            start = time.perf_counter()
            session.post(url, json=BODY, timeout=30).raise_for_status()
            times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def throughput(url: str, clients: int, seconds: float) -> float:
    """Requests per second answered 200 with `clients` concurrent clients."""
    done, stop = [0] * clients, time.monotonic() + seconds

    def client(i: int) -> None:
        with requests.Session() as session:
            while time.monotonic() < stop:
                if session.post(url, json=BODY, timeout=30).status_code == 200:
                    done[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return sum(done) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--port", type=int, default=8765)
    opts = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    serve.start(http_options={"host": "127.0.0.1", "port": opts.port})
    url = f"http://127.0.0.1:{opts.port}/v1/step"
    results = {}
    try:
        for name, build in VARIANTS.items():
            serve.run(build(), name="bench", route_prefix="/")
            p50, p99 = sequential(url, opts.requests)
            results[name] = (p50, p99, throughput(url, opts.clients, opts.seconds))
            print(f"{name:20s} p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  throughput {results[name][2]:7.1f} req/s",
                  flush=True)
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, ray {ray.__version__}")
    base1, base2 = results["bare x1"], results["bare x2"]
    for name, (p50, p99, rps) in results.items():
        if name.startswith("bare"):
            continue
        tput_base = base2 if "2 x" in name else base1
        print(f"{name:20s} p50 {p50 / base1[0]:.2f}x  p99 {p99 / base1[1]:.2f}x  throughput {rps / tput_base[2]:.2f}x "
              f"(of bare x{2 if '2 x' in name else 1})")


if __name__ == "__main__":
    main()
