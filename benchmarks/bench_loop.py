"""The engine's own host work per continuous-batching iteration, apart from the forward.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_loop.py [--sequences 1,8,64,256,1024] [--steps 64]`

1. The generic loop alone: `null_loop` (tests/plugins/null_loop.py), a plugin whose admit / iterate only count (its iterate is the
   "forward": a loop over its sequences and a Delta each), at 1, 8, 64, 256 and 1,024 sequences that all
   run together, inline and on a Ray TP=1 group. Per iteration: host ms (plan, admission, the round trip
   to the rank, applying the deltas, settling requests), forward ms, p50 / p99, from the engine's own
   record (`batch_stats()`: executors/loop_timing.py). Targets (issue "A fast loop"): inline <= 1.0 ms at
   256 sequences and <= 0.3 ms at 8; a Ray TP=1 group <= 1.5 ms at 8.
2. `hf_causal_lm` on a tiny Qwen2 (hidden 64, 2 layers, fp32), `reference_flow_policy`: N requests at
   once, inline, the same record: host ms and the forward's share of each iteration.
3. The tiny Qwen2's throughput against transformers' one left-padded `generate` of the same prompts,
   alternated in one process (tokens compared, medians of 5) and each alone in fresh processes (each the
   median of its runs 2-4; the median of 2 such processes):
   targets >= 1.5x at 64 requests, >= 2x at 256.
Columns: iterations run, host ms and forward ms per iteration (p50, p99), the median host share of an
iteration, and wall ms per iteration (the whole run from the first submit to the last result over the
iterations: it adds submitting the N requests and the iterations that admit them).
Prints the machine first (cores, torch's thread count: the defaults a user gets), then the table, then
each target. `--threads N` sets torch's intra-op threads; `--json PATH` writes the rows (benchmarks/plot.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results  # noqa: E402
from benchmarks.bench_generation import machine, verdict  # noqa: E402
from phyai_ray import BatchingConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig  # noqa: E402
from tests.plugins.null_loop import NullLoopEntry  # noqa: E402


THREADS_SET = False  # --threads was given: the fresh processes of `alone` get it too


def batching(n: int) -> BatchingConfig:
    return BatchingConfig(max_num_seqs=max(n, 1), max_num_batched_tokens=max(n, 4096))


def loop_stats(engine: Engine, requests: list[Any], timeout: float = 600) -> dict[str, Any]:
    """Submit `requests` at once, wait for all, and read the replica's iteration record."""
    started = time.perf_counter()
    futures = [engine.submit(r) for r in requests]
    for f in futures:
        f.result(timeout=timeout)
    wall = time.perf_counter() - started
    stats = engine.batch_stats()[0]
    return {"wall_s": wall, "iterations": stats["iterations"], "host_ms": stats["iteration_host_ms"],
            "forward_ms": stats["iteration_forward_ms"], "parts_ms": stats["iteration_parts_ms"],
            "host_share": stats["iteration_host_share"]}


def null_loop(n: int, steps: int, mode: str) -> dict[str, Any]:
    args = EngineArgs(plugin=NullLoopEntry, config=EngineConfig(device=DeviceConfig(target="cpu")))
    deployment = DeploymentConfig(mode=mode, replica_count=1, cpus_per_rank=0.5, batching=batching(n))
    with Engine(args, deployment) as engine:
        loop_stats(engine, [{"steps": 4}] * min(n, 8))  # warm: the rank's first iterations
        return loop_stats(engine, [{"steps": steps}] * n)


def hf_causal_lm(n: int, tokens: int) -> dict[str, Any]:
    from tests.hf_checkpoints import write_checkpoint

    folder = write_checkpoint(Path(tempfile.mkdtemp(prefix="bench-loop-")) / "qwen2", "qwen2")
    args = EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    request = lambda p: {"prompts": [p], "max_tokens": tokens, "ignore_eos": True}  # noqa: E731
    with Engine(args, DeploymentConfig(mode="inline", batching=batching(n))) as engine:
        loop_stats(engine, [request(p) for p in prompts(4)])
        return loop_stats(engine, [request(p) for p in prompts(n)])


def vs_transformers(sizes: list[int], tokens: int = 32, repeats: int = 5) -> list[str]:
    """N one-prompt greedy requests at once through an inline engine against transformers' ONE left-padded
    `generate` of the same prompts (the tiny Qwen2: the forward is short, so the engine's host work
    decides), two ways, medians of `repeats`:
    * alternated in one process (the engine's run, then transformers', `repeats` times);
    * each alone: in fresh processes of their own that never ran the other (`--alone ours|transformers`;
      each process's median of its runs 2-4): nothing of one side's threads is left in the other's.
    Both, because the first is not the second on a small machine: transformers' `generate` runs its
    forward on the caller's thread with its own OpenMP team, the engine on its loop thread with
    another; with more OpenMP threads than cores, libgomp stops spinning at its barriers and every
    parallel op pays a futex wake-up (see docs/benchmarks.md)."""
    from benchmarks.bench_hf import alternated, engine_many
    from tests.hf_checkpoints import load_reference, write_checkpoint

    folder = write_checkpoint(Path(tempfile.mkdtemp(prefix="bench-loop-")) / "qwen2", "qwen2")
    reference, lines = load_reference(folder), []
    args = EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    for n in sizes:
        batch = prompts(n)
        with Engine(args, DeploymentConfig(mode="inline", batching=batching(n))) as engine:
            engine_many(engine, batch, 2)  # the KV cache's rows, outside the timed runs
            rate, ref, same = alternated(engine, reference, batch, tokens, repeats)
        processes = max(repeats // 2, 1)  # each process's own median of 3 runs; the median over the processes
        ours_alone = sorted(alone("ours", folder, n, tokens) for _ in range(processes))[processes // 2]
        theirs_alone = sorted(alone("transformers", folder, n, tokens) for _ in range(processes))[processes // 2]
        apart = theirs_alone / ours_alone
        results.record("vs_transformers", requests=n, ours_tok_s=rate, transformers_tok_s=ref, ratio=rate / ref,
                       equal_tokens=same, ours_alone_s=ours_alone, transformers_alone_s=theirs_alone,
                       ratio_alone=apart)
        lines.append(f"  N={n:4d} alternated: hf_causal_lm {rate:7.0f} tok/s, transformers one padded batch "
                     f"{ref:7.0f} tok/s, ratio {rate / ref:.2f}x, equal tokens {same}/{n}")
        lines.append(f"  N={n:4d} each alone: hf_causal_lm {1e3 * ours_alone:6.1f} ms, transformers "
                     f"{1e3 * theirs_alone:6.1f} ms, ratio {apart:.2f}x")
        target = 1.5 if n <= 64 else 2.0
        lines.append(verdict(f"tiny Qwen2, {n} requests / generate, alternated", rate / ref, target, True))
        lines.append(verdict(f"tiny Qwen2, {n} requests / generate, each alone", apart, target, True))
    return lines


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 200 + 3 for j in range(8 + i % 16)] for i in range(n)]


def alone(side: str, folder: Path, n: int, tokens: int) -> float:
    """Seconds of a run of `side` in a fresh process: the median of its runs 2-4 (the first warms it)."""
    import json
    import subprocess

    threads = ["--threads", str(torch.get_num_threads())] if THREADS_SET else []  # else torch's own default
    out = subprocess.run([sys.executable, __file__, "--alone", side, "--folder", str(folder), "--n", str(n),
                          "--tokens", str(tokens), *threads], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def run_alone(side: str, folder: str, n: int, tokens: int, runs: int = 3) -> None:
    import json

    from benchmarks.bench_hf import engine_many, transformers_batch
    from tests.hf_checkpoints import load_reference

    batch = prompts(n)
    if side == "transformers":
        reference = load_reference(Path(folder))
        seconds = [transformers_batch(reference, batch, tokens)[0] for _ in range(runs + 1)][1:]
    else:
        args = EngineArgs(plugin="hf_causal_lm", plugin_args={"model": folder},
                          config=EngineConfig(device=DeviceConfig(target="cpu")))
        with Engine(args, DeploymentConfig(mode="inline", batching=batching(n))) as engine:
            seconds = [engine_many(engine, batch, tokens)[0] for _ in range(runs + 1)][1:]
    print(json.dumps({"seconds": sorted(seconds)[runs // 2]}))


def flow_policy(n: int) -> dict[str, Any]:
    args = EngineArgs(plugin="reference_flow_policy", plugin_args={"seed": 0},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    with Engine(args, DeploymentConfig(mode="inline", batching=batching(n))) as engine:
        frames = [{"state": torch.randn(8, generator=torch.Generator().manual_seed(i)).tolist(), "step": i}
                  for i in range(n)]
        loop_stats(engine, frames[:2])
        return loop_stats(engine, frames)


def row(name: str, n: int, r: dict[str, Any]) -> str:
    host, fwd = r["host_ms"], r["forward_ms"]
    return (f"  {name:<34} {n:>6} {r['iterations']:>6} {host['p50']:>9.3f} {host['p99']:>9.3f} {fwd['p50']:>9.3f} "
            f"{fwd['p99']:>9.3f} {100 * r['host_share']:>6.1f}% {1e3 * r['wall_s'] / r['iterations']:>9.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", default="1,8,64,256,1024")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--ray", default="1,8,64", help="sequence counts for the Ray TP=1 group")
    parser.add_argument("--plugins", default="64,256", help="request counts for hf_causal_lm / flow policy")
    parser.add_argument("--vs-transformers", default="64,256",
                        help="request counts for the tiny Qwen2 against transformers' generate ('' skips it)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--alone", choices=("ours", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=32, help=argparse.SUPPRESS)
    results.add_flag(parser)
    opts = parser.parse_args(argv)
    if opts.threads:
        global THREADS_SET
        THREADS_SET = True
        torch.set_num_threads(opts.threads)
    if opts.alone:
        return run_alone(opts.alone, opts.folder, opts.n, opts.tokens)
    named = machine()
    print(named)
    print(f"  {'case':<34} {'seqs':>6} {'iters':>6} {'host p50':>9} {'host p99':>9} {'fwd p50':>9} {'fwd p99':>9} "
          f"{'host':>7} {'wall/it':>9}")
    rows: list[dict[str, Any]] = []

    def record(name: str, n: int, result: dict[str, Any]) -> None:
        rows.append({"case": name, "sequences": n, **result})
        results.record("loop", case=name, sequences=n, iterations=result["iterations"],
                       host_p50_ms=result["host_ms"]["p50"], host_p99_ms=result["host_ms"]["p99"],
                       forward_p50_ms=result["forward_ms"]["p50"], forward_p99_ms=result["forward_ms"]["p99"],
                       host_share=result["host_share"], wall_per_iteration_ms=1e3 * result["wall_s"] / result["iterations"])
        print(row(name, n, result), flush=True)

    for n in [int(x) for x in opts.sequences.split(",") if x]:
        record("null_loop inline", n, null_loop(n, opts.steps, "inline"))
    ray_counts = [int(x) for x in opts.ray.split(",") if x]
    if ray_counts:
        import ray

        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                 os.environ.get("PYTHONPATH")]))
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            for n in ray_counts:
                record("null_loop Ray TP=1", n, null_loop(n, opts.steps, "local"))
        finally:
            ray.shutdown()
    for n in [int(x) for x in opts.plugins.split(",") if x]:
        record("hf_causal_lm tiny Qwen2 (32 tokens)", n, hf_causal_lm(n, 32))
        record("reference_flow_policy", n, flow_policy(n))
    sizes = [int(x) for x in opts.vs_transformers.split(",") if x]
    if sizes:
        print("hf_causal_lm vs transformers (tiny Qwen2: hidden 64, 2 layers, fp32; 32 tokens each; medians of 5):")
        for line in vs_transformers(sizes):
            print(line, flush=True)
    results.write(opts.json, "loop", named)
    by = {(r["case"], r["sequences"]): r for r in rows}
    print("targets (host ms per iteration, p50):")
    for case, n, target in (("null_loop inline", 256, 1.0), ("null_loop inline", 8, 0.3), ("null_loop Ray TP=1", 8, 1.5)):
        if (case, n) in by:
            print(verdict(f"{case} at {n} sequences", by[(case, n)]["host_ms"]["p50"], target, False, " ms"))


if __name__ == "__main__":
    main()
