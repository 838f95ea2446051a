"""GRPO's traffic on 2 replicas: prefix affinity (`routing="affinity"`) against the default fewest in-flight.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_affinity.py [--prompts 16] [--samples 8] [--prompt-tokens 384]`

`prompts` x `samples` requests of one prompt each (every sample of a prompt the same prompt, sampled at
temperature 1 with its own seed), all submitted at once to an Engine of 2 Ray replicas (one rank each) of
`hf_causal_lm` on a tiny Qwen2 (hidden 64, 2 layers), once per routing, alternated, `--repeats` times.
Prints per routing: tokens/s, p50 / p99 request latency (submit to result), the prefix cache's hits as a
share of the ideal (every sample after a prompt's first finds its whole prompt cached: (samples - 1) /
samples of the prompt tokens looked up), and the ratio affinity / fewest in-flight. Target (issue
"Goodput under real traffic"): >= 1.3x tokens/s at equal or better p99, hits >= 90% of the ideal.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results  # noqa: E402
from benchmarks.results import machine, quantile  # noqa: E402


def run(folder: Path, routing: str, requests: list[dict], slack: int) -> dict:
    from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig

    deployment = DeploymentConfig(mode="local", replica_count=2, cpus_per_rank=1.0, routing=routing,
                                  affinity_slack=slack)
    args = EngineArgs(plugin="hf_causal_lm", plugin_args={"model": str(folder)},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    with Engine(args, deployment) as engine:
        engine.step({"prompts": [[5] * 8], "max_tokens": 2})  # both replicas' first iterations, untimed
        engine.step({"prompts": [[6] * 8], "max_tokens": 2})
        before = engine.collective_rpc("prefix_cache_stats")
        started = time.perf_counter()
        sent = [(time.perf_counter(), engine.submit(r)) for r in requests]
        latencies, tokens = [], 0
        for at, future in sent:
            out = future.result(timeout=600)[0]
            latencies.append(time.perf_counter() - at)
            tokens += len(out.token_ids)
        seconds = time.perf_counter() - started
        after = engine.collective_rpc("prefix_cache_stats")
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before))
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before))
    return {"tokens_s": tokens / seconds, "p50_s": quantile(latencies, 0.5), "p99_s": quantile(latencies, 0.99),
            "hits": hits, "queries": queries}


def main(argv: list[str] | None = None) -> None:
    import ray

    from tests.hf_checkpoints import SHAPE, write_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per sample")
    parser.add_argument("--slack", type=int, default=8, help="affinity_slack")
    parser.add_argument("--repeats", type=int, default=2)
    results.add_flag(parser)
    opts = parser.parse_args(argv)
    print(f"machine: {machine()}")
    folder = write_checkpoint(Path(tempfile.mkdtemp(prefix="bench-affinity-")) / "qwen2", "qwen2",
                              shape={**SHAPE, "max_position_embeddings": 2048})
    prompts = [[(13 * i + 7 * j) % 250 + 3 for j in range(opts.prompt_tokens)] for i in range(opts.prompts)]
    requests = [{"prompts": [p], "max_tokens": opts.tokens, "temperature": 1.0, "seed": 1000 * i + k,
                 "ignore_eos": True} for i, p in enumerate(prompts) for k in range(opts.samples)]
    ideal = (opts.samples - 1) / opts.samples
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        rows: dict[str, list[dict]] = {"affinity": [], "least_loaded": []}
        for _ in range(opts.repeats):
            for routing in rows:
                rows[routing].append(run(folder, routing, requests, opts.slack))
    finally:
        ray.shutdown()
    print(f"{opts.prompts} prompts x {opts.samples} samples, {opts.prompt_tokens}-token prompts, {opts.tokens} tokens "
          f"each, 2 replicas; medians of {opts.repeats}:")
    best = {}
    for routing, runs in rows.items():
        pick = lambda key: sorted(r[key] for r in runs)[len(runs) // 2]  # noqa: E731
        hits = sum(r["hits"] for r in runs) / max(sum(r["queries"] for r in runs), 1)
        best[routing] = {"tokens_s": pick("tokens_s"), "p50_s": pick("p50_s"), "p99_s": pick("p99_s"), "hits": hits}
        results.record("affinity", routing=routing, **best[routing])
        print(f"  {routing:<13} {best[routing]['tokens_s']:8.0f} tok/s  p50 {1e3 * best[routing]['p50_s']:7.0f} ms  "
              f"p99 {1e3 * best[routing]['p99_s']:7.0f} ms  prefix hits {100 * hits:5.1f}% of tokens looked up "
              f"({100 * hits / ideal:5.1f}% of the ideal)")
    a, b = best["affinity"], best["least_loaded"]
    ratio = a["tokens_s"] / b["tokens_s"]
    print(f"  affinity / fewest in-flight: {ratio:.2f}x tokens/s (target >= 1.3x), p99 {a['p99_s'] / b['p99_s']:.2f}x "
          f"(target <= 1x), hits {100 * a['hits'] / ideal:.0f}% of the ideal (target >= 90%): "
          f"{'met' if ratio >= 1.3 and a['p99_s'] <= b['p99_s'] and a['hits'] >= 0.9 * ideal else 'NOT MET'}")
    results.write(opts.json, "affinity", machine())


if __name__ == "__main__":
    main()
