"""Token generation: many one-prompt requests vs the same prompts as one request, and streamed HTTP completions.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_generation.py [--only engine|http] [--requests 128,512]
      [--tokens 32]`

1. Engine: reference_lm (dim 64, 4 heads, 2 layers, vocab 128) in three deployments (inline; 1 replica
   x TP=2; 2 replicas x TP=1). For each N in `--requests`: N one-prompt requests submitted at once
   (prompts of 4..12 tokens, greedy, `--tokens` tokens each) against the same N prompts as ONE request
   to the same engine: tokens/s of both and their ratio (target >= 0.7). Latency comes from
   a separate streamed run of the same N requests (one consumer thread per request records when each
   chunk arrives), so the throughput run carries no consumer threads: time to first token (from the
   request's own submission) and inter-token latency (the gaps a reader sees: chunks relayed from
   rank actors may arrive several at once), p50 / p99. The streamed run of an N is skipped when its
   throughput run took longer than `--stream-budget-s` (30): one step per request is slow enough
   that repeating it would take the whole run well past five minutes on a 2-core machine.
   One decode step of a batch of 64: the time of one 64-prompt request divided by its tokens per
   prompt (best of 3, prefill included); against it the inter-token p99 of 64 streamed one-prompt
   requests running at once (target <= 3x), as their readers see it (64 reader threads in the
   benchmark's process: for inline engines they share the GIL with the engine) and engine-side (the
   time of each iteration of that run, plan sent to deltas back, `IterationLoop.durations`).
   Throughput is the median of 3 interleaved runs of each side.
2. HTTP: the phyai-ray Serve app with the OpenAI routes, 2 groups x TP=2 (4 rank actors at 0.5 CPU
   each), `--http-streams` concurrent streamed /v1/completions of `--http-tokens` tokens sent with the
   `openai` client (AsyncOpenAI; plain `requests` with SSE parsing when the package is missing):
   total tokens/s (target >= 1100, 10x the 110 tok/s measured before) and inter-token p50 / p99;
   then, for context, the same with `stream_interval=4` (one SSE write per 4 token steps) and the
   same two groups at TP=1 (no collectives).
Each deployment says whether its engine batched per iteration or ran every request as one step.
Prints the machine first, then every measurement, then each ratio with its target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import threading
import time
from typing import Any

import torch

import results  # noqa: E402  (benchmarks/results.py, beside this script)
from phyai_ray import (AttentionParallelConfig, BatchingConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig,
                       Engine, EngineArgs, EngineConfig, ParallelConfig)

PLUGIN_ARGS = {"seed": 0, "dim": 64, "heads": 4, "layers": 2, "vocab": 128, "max_seq": 256}
BATCHING = BatchingConfig(max_num_seqs=256, max_num_batched_tokens=4096)
DEPLOYMENTS = {"inline": 1, "1 x TP=2": 2, "2 x TP=1": 1}  # name -> tp
DECODE_BATCH = 64
REPEATS = 3  # throughput: the median of this many interleaved runs of each side
HTTP_TARGET_TOKENS_S = 1100.0


def prompts(count: int, offset: int = 0) -> list[list[int]]:
    """`count` prompts of 4..12 tokens, all different."""
    vocab = PLUGIN_ARGS["vocab"]
    return [[(7 * (i + offset) + 3 * j + 1) % vocab for j in range(4 + (i + offset) % 9)] for i in range(count)]


def generate(batch: list[list[int]], tokens: int) -> dict[str, Any]:
    return {"prompts": batch, "max_tokens": tokens, "temperature": 0.0, "seed": 0}


def engine_args(tp: int) -> EngineArgs:
    parallel = (ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
                if tp > 1 else ParallelConfig())
    return EngineArgs(plugin="reference_lm", plugin_args=PLUGIN_ARGS,
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))


def deployment(name: str) -> DeploymentConfig:
    if name == "inline":
        return DeploymentConfig(batching=BATCHING)  # auto: one rank, one replica -> inline
    replicas = 2 if name.startswith("2") else 1
    return DeploymentConfig(mode="local", replica_count=replicas, cpus_per_rank=0.5, batching=BATCHING)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def token_count(outputs: list) -> int:
    return sum(len(o.token_ids) for o in outputs)


def many(engine: Engine, batch: list[list[int]], tokens: int) -> tuple[float, list]:
    """(wall seconds, one output per prompt): one request per prompt, all submitted at once."""
    start = time.perf_counter()
    futures = [engine.submit(generate([p], tokens)) for p in batch]
    outputs = [f.result(timeout=600)[0] for f in futures]
    return time.perf_counter() - start, outputs


def as_one(engine: Engine, batch: list[list[int]], tokens: int, repeats: int = 2) -> tuple[float, list]:
    """(best wall seconds of `repeats`, outputs): every prompt in ONE request."""
    best, outputs = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = engine.submit(generate(batch, tokens)).result(timeout=600)
        best = min(best, time.perf_counter() - start)
    return best, outputs


def streamed(engine: Engine, batch: list[list[int]], tokens: int) -> dict[str, Any]:
    """One streamed request per prompt, each read by its own thread, all started at once: time to first
    token (from that request's submission), gaps between its chunks, tokens/s of the whole run."""
    ttft: list[float] = []
    gaps: list[float] = []
    counts = [0] * len(batch)
    errors: list[BaseException] = []
    lock, go = threading.Lock(), threading.Event()

    def consume(k: int) -> None:
        go.wait()
        arrivals, got = [], 0
        submitted = time.perf_counter()
        try:
            for chunk in engine.stream(generate([batch[k]], tokens)):
                now = time.perf_counter()
                if chunk["token_ids"][0] is not None:
                    arrivals.append(now)
                    got += 1
        except BaseException as exc:  # reported after the run
            with lock:
                errors.append(exc)
            return
        with lock:
            counts[k] = got
            if arrivals:
                ttft.append(arrivals[0] - submitted)
                gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))

    threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in range(len(batch))]
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.set()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} streamed request(s) failed, first: {errors[0]!r}")
    return {"rate": sum(counts) / wall, "ttft": ttft, "itl": gaps}


def iteration_times(engine: Engine, before: list[int]) -> list[float]:
    """Seconds of every iteration each replica ran since its `iterations` count was `before`."""
    times = []
    for executor, stats, start in zip(engine._executors, engine.batch_stats(), before):
        if executor.queue.iterative:
            times += executor.queue.durations(stats["iterations"] - start)
    return times


def iteration_path(engine: Engine) -> bool:
    """Whether this engine's replicas batch per iteration (their stats then count running sequences)."""
    return all("running_sequences" in s for s in engine.batch_stats())


def bench_engine(name: str, tp: int, sizes: list[int], tokens: int, stream_budget_s: float) -> dict[str, Any]:
    rows, out = [], {}
    with Engine(engine_args(tp), deployment(name)) as engine:
        warm = prompts(16, offset=1000)
        many(engine, warm, tokens)
        as_one(engine, warm, tokens, repeats=1)
        streamed(engine, warm[:4], tokens)
        out["path"] = "per-iteration batching" if iteration_path(engine) else "one step per request"
        print(f"{name}: {engine.mode} engine, {len(engine.replica_status())} replica(s), {out['path']}", flush=True)
        for n in sizes:
            batch = prompts(n)
            walls_many, walls_one = [], []
            for _ in range(REPEATS):  # interleaved, so a noisy moment of a shared machine hits both
                wall, outs_many = many(engine, batch, tokens)
                walls_many.append(wall)
                wall, outs_one = as_one(engine, batch, tokens, repeats=1)
                walls_one.append(wall)
            wall_many, wall_one = statistics.median(walls_many), statistics.median(walls_one)
            # the streamed run repeats the same work: skip it where that alone would overrun the budget
            stream = streamed(engine, batch, tokens) if wall_many <= stream_budget_s else None
            differ = sum(a.token_ids != b.token_ids for a, b in zip(outs_many, outs_one))
            row = {"n": n, "many": token_count(outs_many) / wall_many, "one": token_count(outs_one) / wall_one,
                   "differ": differ}
            rows.append(row)
            latency = (f"streamed {stream['rate']:7.0f} tok/s  TTFT p50 {pct(stream['ttft'], .5) * 1e3:7.1f} ms  "
                       f"p99 {pct(stream['ttft'], .99) * 1e3:7.1f} ms  ITL p50 {pct(stream['itl'], .5) * 1e3:6.2f} ms  "
                       f"p99 {pct(stream['itl'], .99) * 1e3:7.2f} ms" if stream is not None else
                       f"streamed run skipped (the run above took {wall_many:.0f} s > --stream-budget-s "
                       f"{stream_budget_s:g})")
            print(f"  N={n:4d}  {n} one-prompt requests {row['many']:8.0f} tok/s | as one request {row['one']:8.0f} "
                  f"tok/s | ratio {row['many'] / row['one']:5.2f} | {latency} | "
                  f"{differ} prompt(s) with other tokens than as one request", flush=True)
        decode = prompts(DECODE_BATCH, offset=2000)
        wall64, _ = as_one(engine, decode, tokens, repeats=3)
        out["step64"] = wall64 / tokens
        before = [s.get("iterations", 0) for s in engine.batch_stats()]
        at64 = streamed(engine, decode, tokens)
        out["itl64_p50"], out["itl64_p99"] = pct(at64["itl"], .5), pct(at64["itl"], .99)
        engine_side = iteration_times(engine, before)
        out["iter64_p99"] = pct(engine_side, .99) if engine_side else None
        print(f"  one decode step of a batch of {DECODE_BATCH} (a {DECODE_BATCH}-prompt request / {tokens} tokens): "
              f"{out['step64'] * 1e3:.2f} ms | ITL of {DECODE_BATCH} streamed one-prompt requests at once: "
              f"p50 {out['itl64_p50'] * 1e3:.2f} ms  p99 {out['itl64_p99'] * 1e3:.2f} ms"
              + (f" | engine side, one iteration of that run (plan sent to deltas back): p50 "
                 f"{pct(engine_side, .5) * 1e3:.2f} ms  p99 {pct(engine_side, .99) * 1e3:.2f} ms" if engine_side
                 else ""), flush=True)
    out["rows"] = rows
    return out


# -- HTTP: streamed /v1/completions through the Serve app ---------------------------------------
def openai_client_available() -> bool:
    try:
        import openai  # noqa: F401
    except ImportError:
        return False
    return True


async def openai_streams(base: str, batch: list[list[int]], tokens: int) -> list[tuple[float, list[float], int]]:
    """Per request (submitted time, arrival time of each token event, tokens), all requests at once."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(prompt: list[int]) -> tuple[float, list[float], int]:
        submitted, arrivals, got = time.perf_counter(), [], 0
        events = await client.completions.create(model="reference_lm", prompt=prompt, max_tokens=tokens,
                                                 temperature=0.0, stream=True)
        async for event in events:
            now = time.perf_counter()
            n = sum(len(getattr(c, "token_ids", None) or []) for c in event.choices)
            if n:
                arrivals.append(now)
                got += n
        return submitted, arrivals, got
    try:
        return list(await asyncio.gather(*(one(p) for p in batch)))
    finally:
        await client.close()


def sse_streams(base: str, batch: list[list[int]], tokens: int) -> list[tuple[float, list[float], int]]:
    """The same with `requests` and hand-parsed server-sent events, one thread per request."""
    import requests as http

    results: list = [None] * len(batch)

    def one(k: int) -> None:
        submitted, arrivals, got = time.perf_counter(), [], 0
        body = {"model": "reference_lm", "prompt": batch[k], "max_tokens": tokens, "temperature": 0.0, "stream": True}
        with http.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                n = sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
                if n:
                    arrivals.append(time.perf_counter())
                    got += n
        results[k] = (submitted, arrivals, got)
    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def bench_http(streams: int, tokens: int, port: int, tp: int = 2, stream_interval: int = 1) -> dict[str, Any]:
    from ray import serve

    from phyai_ray.serve import create_app

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    use_openai = openai_client_available()
    send = ((lambda b: asyncio.run(openai_streams(base, b, tokens))) if use_openai
            else (lambda b: sse_streams(base, b, tokens)))
    try:
        app = create_app(engine_args(tp), DeploymentConfig(replica_count=2, cpus_per_rank=0.5, batching=BATCHING),
                         stream_interval=stream_interval)
        serve.run(app, name="bench-generation", route_prefix="/")
        send(prompts(8, offset=3000))  # warm-up: connections, both groups
        start = time.perf_counter()
        results = send(prompts(streams))
        wall = time.perf_counter() - start
        serve.delete("bench-generation")
    finally:
        serve.shutdown()
    gaps = [b - a for _, arrivals, _ in results for a, b in zip(arrivals, arrivals[1:])]
    ttft = [arrivals[0] - submitted for submitted, arrivals, _ in results if arrivals]
    return {"client": "openai.AsyncOpenAI" if use_openai else "requests + SSE parsing (openai not installed)",
            "rate": sum(n for _, _, n in results) / wall, "tokens": sum(n for _, _, n in results), "wall": wall,
            "itl": gaps, "ttft": ttft}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    import ray

    return (f"machine: {platform.platform()}, {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads), ray {ray.__version__}")


def verdict(name: str, value: float, target: float, higher_is_better: bool, unit: str = "x") -> str:
    met = value >= target if higher_is_better else value <= target
    return (f"  {name:<62} {value:8.2f}{unit:<6} target {'>=' if higher_is_better else '<='} {target:g}{unit}  "
            f"{'met' if met else 'NOT MET'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("engine", "http"), help="run one part only")
    parser.add_argument("--requests", default="128,512", help="comma-separated counts of one-prompt requests")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt (engine part)")
    parser.add_argument("--http-streams", type=int, default=48)
    parser.add_argument("--http-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--stream-budget-s", type=float, default=30.0,
                        help="skip the streamed latency run of an N whose throughput run took longer than this")
    results.add_flag(parser)
    opts = parser.parse_args()
    sizes = [int(s) for s in opts.requests.split(",") if s.strip()]
    import ray

    print(machine(), flush=True)
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    lines = []
    began = time.perf_counter()
    try:
        for name, tp in DEPLOYMENTS.items() if opts.only in (None, "engine") else ():
            r = bench_engine(name, tp, sizes, opts.tokens, opts.stream_budget_s)
            for row in r["rows"]:
                results.record("engine", deployment=name, n=row["n"], one_prompt_tok_s=row["many"],
                               one_request_tok_s=row["one"])
                lines.append(verdict(f"{name}, N={row['n']}: one-prompt requests / one request",
                                     row["many"] / row["one"], 0.7, True))
            lines.append(verdict(f"{name}: ITL p99 at {DECODE_BATCH} running / one decode step of {DECODE_BATCH}",
                                 r["itl64_p99"] / r["step64"], 3.0, False))
            if r["iter64_p99"] is not None:
                lines.append(verdict(f"{name}: engine-side iteration p99 at {DECODE_BATCH} running / one decode step",
                                     r["iter64_p99"] / r["step64"], 3.0, False))
            if r["path"] != "per-iteration batching":
                lines.append(f"    ^ {name} ran every request as one step (no per-iteration batching): "
                             "its ITL is one request's alone")
        if opts.only in (None, "http"):
            # the target's topology; then, for context, one write per 4 tokens, and the groups without collectives
            for tp, interval in ((2, 1), (2, 4), (1, 1)):
                h = bench_http(opts.http_streams, opts.http_tokens, opts.port, tp, interval)
                print(f"HTTP 2 groups x TP={tp}, stream_interval={interval}, {opts.http_streams} concurrent streamed "
                      "/v1/completions of "
                      f"{opts.http_tokens} tokens ({h['client']}): {h['tokens']} tokens in {h['wall']:.2f} s = "
                      f"{h['rate']:.0f} tok/s | "
                      f"TTFT p50 {pct(h['ttft'], .5) * 1e3:.1f} ms  p99 {pct(h['ttft'], .99) * 1e3:.1f} ms | "
                      f"ITL p50 {pct(h['itl'], .5) * 1e3:.2f} ms  p99 {pct(h['itl'], .99) * 1e3:.2f} ms", flush=True)
                if (tp, interval) == (2, 1):
                    lines.append(verdict("HTTP streamed completions (2 groups x TP=2), total tokens/s", h["rate"],
                                         HTTP_TARGET_TOKENS_S, True, " tok/s"))
    finally:
        ray.shutdown()
    print(f"\nratios (whole run {time.perf_counter() - began:.0f} s):")
    print("\n".join(lines))
    results.write(opts.json, "generation", machine())


if __name__ == "__main__":
    main()
