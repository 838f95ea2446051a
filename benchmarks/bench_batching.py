"""Batching inside a replica group: many one-sample requests vs the same samples as one request, side by side.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_batching.py [--requests 1000] [--clients 64] [--skip-http]`

1. Engine: `--requests` one-sample requests to reference_dit (16 tokens, CFG) from `--clients` threads
   in three deployments (inline; 1 replica x TP=2; 2 replicas x TP=1), against the same samples sent as
   ONE request to the same engine: throughput ratio (target >= 0.7), p50 / p99 latency. Two client
   shapes: "fleet" (each thread submits its share as the samples arrive, then collects the results:
   many producers feeding one replica group) and "closed loop" (each thread waits for its reply before
   sending the next: a control loop), with batching on (max_batch_size = clients) and off.
2. Inline thread hand-off, batching off: per-request time of concurrent `submit()` calls vs sequential
   `step()` calls (target <= 1.3x), each in a fresh process, and both in one process for comparison.
3. HTTP: the same traffic through the phyai-ray Serve app (one group, TP=1, batching on) vs a bare Ray
   Serve deployment that wraps the same model in `@serve.batch` with the same max_batch_size and wait
   (throughput target >= 1.0x, p50 <= 1.3x).
4. Defaults (`--only defaults`): `--default-requests` (256) one-sample requests from `--clients`
   threads with NO BatchingConfig, so the plugin's own default applies (reference_dit: 64, delay 0),
   against the same samples as one request, in the three deployments (target >= 0.4), results equal.
Prints the machine first, then every measurement, then each ratio with its target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable

import torch
from fastapi import FastAPI

import results  # noqa: E402  (benchmarks/results.py, beside this script)
from phyai_ray import (AttentionParallelConfig, BatchingConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig,
                       Engine, EngineArgs, EngineConfig, ParallelConfig)

SEQ, SCALE = 16, 4.0
HTTP_BATCH, HTTP_WAIT_S = 32, 0.002
CLOSED_LOOP_DELAY_MS = 20.0  # about one step: the clients a step answered rejoin the next batch


def sample(i: int) -> dict[str, Any]:
    return {"tokens": [[(7 * i + j) % 128 for j in range(SEQ)]], "labels": [i % 10], "guidance_scale": SCALE}


def as_one(requests: list[dict]) -> dict[str, Any]:
    return {"tokens": [r["tokens"][0] for r in requests], "labels": [r["labels"][0] for r in requests],
            "guidance_scale": SCALE}


def engine_args(tp: int) -> EngineArgs:
    parallel = (ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
                if tp > 1 else ParallelConfig())
    return EngineArgs(plugin="reference_dit", plugin_args={"seed": 0},
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))


def deployment(name: str, batch: int | None, delay_ms: float = 0.0) -> DeploymentConfig:
    """`batch=None`: no BatchingConfig given (the plugin's default batching)."""
    batching = BatchingConfig() if batch is None else \
        BatchingConfig(max_batch_size=batch, max_batch_delay_ms=delay_ms if batch > 1 else 0.0)
    if name == "inline":
        return DeploymentConfig(batching=batching)
    replicas = 2 if name.startswith("2") else 1
    return DeploymentConfig.local(replica_count=replicas, cpus_per_rank=0.5, batching=batching)


DEPLOYMENTS = {"inline": 1, "1 x TP=2": 2, "2 x TP=1": 1}  # name -> tp


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def fleet(engine: Engine, requests: list, clients: int) -> tuple[float, list[float], list]:
    """(wall seconds, per-request latencies, results): `clients` threads submit their share of
    `requests` without waiting, then collect them."""
    shares = [requests[i::clients] for i in range(clients)]
    done: list = [None] * clients

    def client(k: int) -> None:
        sent = []
        for r in shares[k]:
            future, submitted = engine.submit(r), time.perf_counter()
            future.add_done_callback(lambda f, t=submitted: setattr(f, "latency", time.perf_counter() - t))
            sent.append(future)
        wait(sent, timeout=600)  # one wake-up per client, not one per result
        deadline = time.monotonic() + 30  # the latency callbacks run on the engine's callback thread
        while not all(hasattr(f, "latency") for f in sent) and time.monotonic() < deadline:
            time.sleep(0.001)
        done[k] = [(f.result(), f.latency) for f in sent]
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - start
    results: list = [None] * len(requests)
    for k, items in enumerate(done):
        for j, (value, _) in enumerate(items):
            results[k + j * clients] = value
    return wall, [lat for items in done for _, lat in items], results


def closed_loop(call: Callable[[Any], Any], requests: list, clients: int) -> tuple[float, list[float], list]:
    """(wall seconds, per-request latencies, results): `clients` threads, each sending its next request
    when its previous one returned."""
    results: list = [None] * len(requests)
    latencies: list[float] = []
    next_index, lock = [0], threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(requests):
                return
            start = time.perf_counter()
            results[i] = call(requests[i])
            latencies.append(time.perf_counter() - start)
    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return time.perf_counter() - start, latencies, results


def one_request_rate(engine: Engine, requests: list) -> float:
    """Samples per second of the same samples as ONE request (best of 3 after a warm-up)."""
    batched = as_one(requests)
    engine.step(batched)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        engine.step(batched)
        times.append(time.perf_counter() - start)
    return len(requests) / min(times)


def bench_engine(name: str, tp: int, count: int, clients: int, batch: int | None, shape: str) -> dict[str, Any]:
    requests = [sample(i) for i in range(count)]
    delay_ms = CLOSED_LOOP_DELAY_MS if shape == "closed loop" and batch is not None and batch > 1 else 0.0
    with Engine(engine_args(tp), deployment(name, batch, delay_ms)) as engine:
        run = (lambda reqs: fleet(engine, reqs, clients)) if shape == "fleet" else \
            (lambda reqs: closed_loop(engine.step, reqs, clients))
        run(requests[: 2 * clients])  # warm-up
        wall, lat, results = run(requests)
        rate = one_request_rate(engine, requests)
        want = engine.step(as_one(requests[:8]))
        size = engine.batch_stats()[0]["max_batch_size"]
    error = max(float((results[i][0] - want[i]).abs().max() / want[i].abs().max()) for i in range(8))
    return {"rate": count / wall, "one": rate, "p50": statistics.median(lat), "p99": p99(lat), "error": error,
            "max_batch_size": size}


def hand_off_child(mode: str, count: int) -> float:
    """Per-request seconds of the inline engine in this process: "seq" step() calls, "conc" submit() calls
    from 64 threads, "mixed" seq then conc in one process (returns the conc time)."""
    requests = [sample(i) for i in range(count)]
    with Engine(engine_args(1)) as engine:
        def seq() -> float:
            [engine.step(r) for r in requests[:16]]
            start = time.perf_counter()
            [engine.step(r) for r in requests]
            return (time.perf_counter() - start) / count

        def conc() -> float:
            with ThreadPoolExecutor(64) as pool:
                [f.result() for f in list(pool.map(engine.submit, requests[:64]))]
                start = time.perf_counter()
                [f.result() for f in list(pool.map(engine.submit, requests))]
            return (time.perf_counter() - start) / count
        if mode == "mixed":
            seq()
        return seq() if mode == "seq" else conc()


def bench_hand_off(count: int) -> dict[str, float]:
    out = {}
    for mode in ("seq", "conc", "mixed"):
        times = []
        for _ in range(3):
            proc = subprocess.run([sys.executable, __file__, "--hand-off-child", mode, "--requests", str(count)],
                                  capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.getcwd()})
            if proc.returncode:
                raise RuntimeError(f"hand-off child {mode} failed: {proc.stderr[-2000:]}")
            times.append(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])
        out[mode] = statistics.median(times)
    return out


# -- HTTP: phyai-ray's Serve app vs a bare @serve.batch deployment of the same model ----------------
def bare_app() -> Any:
    from ray import serve

    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    @serve.ingress(api)
    class BareBatchedDiT:
        def __init__(self) -> None:
            from phyai_ray.executors.inline import build_inline_runner
            from phyai_ray.plugins.registry import resolve_plugin

            args = engine_args(1)
            self.model = build_inline_runner(resolve_plugin("reference_dit"), args.plugin_args,
                                             args.config.parallel, args.config.device).model

        @serve.batch(max_batch_size=HTTP_BATCH, batch_wait_timeout_s=HTTP_WAIT_S)
        async def batch(self, bodies: list[dict]) -> list[Any]:
            return self.model.step_batch(bodies)

        @api.post("/v1/step")
        async def step(self, body: dict) -> dict:  # a plain annotation: this class travels by value
            from phyai_ray.serve.protocols import codec

            return {"result": codec.encode(await self.batch(body))}

    return BareBatchedDiT.bind()


def phyai_app() -> Any:
    from phyai_ray.serve import create_app

    batching = BatchingConfig(max_batch_size=HTTP_BATCH, max_batch_delay_ms=HTTP_WAIT_S * 1000)
    return create_app(engine_args(1), DeploymentConfig(replica_count=1, cpus_per_rank=0.5, batching=batching))


def bench_http(count: int, clients: int, port: int) -> dict[str, dict[str, float]]:
    import ray
    import requests as http
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}/v1/step"
    sessions = threading.local()
    bodies = [sample(i) for i in range(count)]

    def post(body: dict) -> Any:
        if not hasattr(sessions, "s"):
            sessions.s = http.Session()
        reply = sessions.s.post(url, json=body, timeout=60)
        reply.raise_for_status()
        return reply
    out = {}
    try:
        for name, build in (("bare @serve.batch", bare_app), ("phyai-ray group", phyai_app)):
            serve.run(build(), name="bench-batching", route_prefix="/")
            closed_loop(post, bodies[: 2 * clients], clients)
            wall, lat, _ = closed_loop(post, bodies, clients)
            out[name] = {"rate": count / wall, "p50": statistics.median(lat), "p99": p99(lat)}
            serve.delete("bench-batching")
    finally:
        serve.shutdown()
    return out


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    import ray

    return (f"machine: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} intra-op threads), ray {ray.__version__}")


def verdict(name: str, value: float, target: float, higher_is_better: bool) -> str:
    met = value >= target if higher_is_better else value <= target
    return f"  {name:<58} {value:6.2f}x  target {'>=' if higher_is_better else '<='} {target}x  {'met' if met else 'NOT MET'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--unbatched-requests", type=int, default=200)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--default-requests", type=int, default=256)
    parser.add_argument("--only", choices=("engine", "hand-off", "http", "defaults"), help="run one part only")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--hand-off-child", choices=("seq", "conc", "mixed"))
    results.add_flag(parser)
    opts = parser.parse_args()
    if opts.hand_off_child:
        print(json.dumps({"seconds": hand_off_child(opts.hand_off_child, 256)}))
        return
    import ray

    print(machine(), flush=True)
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    lines = []
    try:
        for name, tp in DEPLOYMENTS.items() if opts.only in (None, "engine") else ():
            for shape in ("fleet", "closed loop"):
                on = bench_engine(name, tp, opts.requests, opts.clients, opts.clients, shape)
                off = bench_engine(name, tp, opts.unbatched_requests, opts.clients, 1, shape)
                for label, r in (("batching on", on), ("batching off", off)):
                    print(f"{name:9s} {shape:11s} {label:12s} {r['rate']:6.0f} samples/s  p50 {r['p50'] * 1e3:7.2f} ms  "
                          f"p99 {r['p99'] * 1e3:7.2f} ms | as one request {r['one']:6.0f} samples/s  "
                          f"(max rel err {r['error']:.1e})", flush=True)
                    results.record("engine", deployment=name, shape=shape, batching=label, samples_per_s=r["rate"],
                                   p50_ms=r["p50"] * 1e3, p99_ms=r["p99"] * 1e3, one_request=r["one"])
                if shape == "fleet":
                    lines.append(verdict(f"{name}, fleet: batched requests / one request", on["rate"] / on["one"], 0.7,
                                         True))
                else:
                    lines.append(f"  {name + ', closed loop: batched / one request':<58} {on['rate'] / on['one']:6.2f}x")
                lines.append(f"  {name + ', ' + shape + ': unbatched / one request':<58} {off['rate'] / off['one']:6.2f}x")
        for name, tp in DEPLOYMENTS.items() if opts.only in (None, "defaults") else ():
            r = bench_engine(name, tp, opts.default_requests, opts.clients, None, "fleet")
            print(f"{name:9s} defaults (max_batch_size {r['max_batch_size']}) {r['rate']:6.0f} samples/s  p50 "
                  f"{r['p50'] * 1e3:7.2f} ms  p99 {r['p99'] * 1e3:7.2f} ms | as one request {r['one']:6.0f} samples/s  "
                  f"(max rel err {r['error']:.1e})", flush=True)
            results.record("defaults", deployment=name, samples_per_s=r["rate"], one_request=r["one"])
            lines.append(verdict(f"{name}, defaults, {opts.default_requests} one-sample / one request",
                                 r["rate"] / r["one"], 0.4, True))
        hand = bench_hand_off(256) if opts.only in (None, "hand-off") else None
        if hand:
            print(f"inline, batching off, per request: sequential step() {hand['seq'] * 1e3:.2f} ms, concurrent submit() "
              f"{hand['conc'] * 1e3:.2f} ms (fresh processes); concurrent after sequential in one process "
              f"{hand['mixed'] * 1e3:.2f} ms", flush=True)
            lines.append(verdict("inline concurrent submit() / sequential step()", hand["conc"] / hand["seq"], 1.3, False))
            lines.append(f"  {'  the same, both in one process (two OpenMP pools)':<58} {hand['mixed'] / hand['seq']:6.2f}x")
        if not opts.skip_http and opts.only in (None, "http"):
            http_results = bench_http(opts.requests, opts.clients, opts.port)
            for name, r in http_results.items():
                print(f"HTTP {name:18s} {r['rate']:7.0f} req/s  p50 {r['p50'] * 1e3:7.2f} ms  p99 {r['p99'] * 1e3:7.2f} ms",
                      flush=True)
                results.record("http", variant=name, req_per_s=r["rate"], p50_ms=r["p50"] * 1e3, p99_ms=r["p99"] * 1e3)
            ours, bare = http_results["phyai-ray group"], http_results["bare @serve.batch"]
            lines.append(verdict("HTTP throughput / bare @serve.batch", ours["rate"] / bare["rate"], 1.0, True))
            lines.append(verdict("HTTP p50 / bare @serve.batch", ours["p50"] / bare["p50"], 1.3, False))
            lines.append(f"  {'HTTP p99 / bare @serve.batch (for reference)':<58} {ours['p99'] / bare['p99']:6.2f}x")
    finally:
        ray.shutdown()
    print("\nratios:")
    print("\n".join(lines))
    results.write(opts.json, "batching", machine())


if __name__ == "__main__":
    main()
