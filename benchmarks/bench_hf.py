"""`hf_causal_lm` on a Qwen2-shaped random checkpoint vs transformers' `generate` on the same prompts.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_hf.py [--requests 64,256] [--tokens 32]`

The checkpoint (hidden 512, 8 layers, 8 heads / 2 kv heads, MLP 1408, vocab 16384, separate
lm_head: about 39M parameters, 157 MB in fp32) is written by transformers into a temp folder.

1. Throughput: for each N in `--requests`, N one-prompt greedy requests (prompts of 8..24 tokens,
   `--tokens` tokens each, EOS ignored) submitted at once to an inline engine, against transformers
   generating the same N prompts as ONE left-padded batch (`generate(do_sample=False)`), in the same
   run: tokens/s of both (the median of 3 interleaved runs each) and their ratio (target >= 1.5x at
   N=64). Tokens are checked equal.
2. Latency: the same N requests streamed (one reader thread each): time to first token and
   inter-token latency, p50 / p99.
3. TP=2 vs TP=1 (Ray rank actors, gloo): N one-prompt requests through one group of each (on a
   2-core machine both ranks of TP=2 share the cores TP=1 uses alone: this shows the cost of the
   collectives, not a speed-up).
4. Load time and peak RSS of each rank (VmHWM of the rank process) once loaded, before any request,
   against TP=1's weights plus a rank's fixed overhead (the peak RSS of a rank serving a 5k-parameter
   model): target TP=2 <= 0.6x TP=1's weights + that overhead. The peak after the N requests is
   printed too: it adds the KV cache (one row of max_model_len per running sequence).
Prints the machine first, then every measurement, then each ratio with its target.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_generation import machine, pct, verdict  # noqa: E402
from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig,  # noqa: E402
                       Engine, EngineArgs, EngineConfig, ParallelConfig, WorkerSupervisorConfig)

REPEATS = 3
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=16384, max_position_embeddings=512, tie_word_embeddings=False)


def write_checkpoint(folder: Path) -> int:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE), dtype=torch.float32)
    model.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())


def prompts(count: int) -> list[list[int]]:
    return [[(31 * i + 7 * j + 1) % SHAPE["vocab_size"] for j in range(8 + i % 17)] for i in range(count)]


def request(prompt: list[int], tokens: int) -> dict[str, Any]:
    return {"prompts": [prompt], "max_tokens": tokens, "ignore_eos": True}


def engine_many(engine: Engine, batch: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    futures = [engine.submit(request(p, tokens)) for p in batch]
    outs = [f.result(timeout=1200)[0].token_ids for f in futures]
    return time.perf_counter() - start, outs


def transformers_batch(model: Any, batch: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """ONE left-padded batch through generate(do_sample=False); (seconds, new tokens per prompt)."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return time.perf_counter() - start, out[:, width:].tolist()


def streamed(engine: Engine, batch: list[list[int]], tokens: int) -> tuple[list[float], list[float]]:
    ttft, gaps, lock, go = [], [], threading.Lock(), threading.Event()

    def read(prompt: list[int]) -> None:
        go.wait()
        submitted, arrivals = time.perf_counter(), []
        for chunk in engine.stream(request(prompt, tokens)):
            if chunk["token_ids"][0] is not None:
                arrivals.append(time.perf_counter())
        with lock:
            ttft.append(arrivals[0] - submitted)
            gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))

    threads = [threading.Thread(target=read, args=(p,), daemon=True) for p in batch]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(1200)
    return ttft, gaps


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ray_engine(plugin: str, plugin_args: dict, tp: int) -> Engine:
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp)) \
        if tp > 1 else ParallelConfig()
    return Engine(EngineArgs(plugin=plugin, plugin_args=plugin_args,
                             config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel)),
                  DeploymentConfig(mode="local", cpus_per_rank=0.5,
                                   process_config=WorkerSupervisorConfig(execution_timeout_s=600)))


def main(argv: list[str] | None = None) -> None:
    import ray
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="64,256")
    parser.add_argument("--tokens", type=int, default=32)
    opts = parser.parse_args(argv)
    sizes = [int(n) for n in opts.requests.split(",")]
    print(machine(), flush=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-hf-")) / "qwen2-bench"
    params = write_checkpoint(folder)
    weights_mb = params * 4 / 2 ** 20
    print(f"checkpoint: Qwen2-shaped, {params / 1e6:.1f}M parameters, {weights_mb:.0f} MB fp32, in {folder}",
          flush=True)
    args = {"model": str(folder), "max_model_len": 512}
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ratios = []
    with Engine(EngineArgs(plugin="hf_causal_lm", plugin_args=args,
                           config=EngineConfig(device=DeviceConfig(target="cpu")))) as engine:
        engine_many(engine, prompts(4), 4)  # warm-up
        for n in sizes:
            batch = prompts(n)
            engine_many(engine, batch, 2)  # the KV cache grows to N rows once, outside the timed runs
            ours_runs, theirs_runs = [], []
            for _ in range(REPEATS):
                seconds, our_tokens = engine_many(engine, batch, opts.tokens)
                ours_runs.append(seconds)
                seconds, their_tokens = transformers_batch(reference, batch, opts.tokens)
                theirs_runs.append(seconds)
            ours, theirs = sorted(ours_runs)[REPEATS // 2], sorted(theirs_runs)[REPEATS // 2]
            same = sum(a == b for a, b in zip(our_tokens, their_tokens))
            rate, ref_rate = n * opts.tokens / ours, n * opts.tokens / theirs
            ttft, gaps = streamed(engine, batch, opts.tokens)
            print(f"N={n:4d}: hf_causal_lm {rate:7.0f} tok/s  transformers one padded batch {ref_rate:7.0f} tok/s  "
                  f"ratio {rate / ref_rate:.2f}x  equal tokens {same}/{n} | streamed TTFT p50 "
                  f"{pct(ttft, .5) * 1e3:.0f} ms p99 {pct(ttft, .99) * 1e3:.0f} ms  ITL p50 "
                  f"{pct(gaps, .5) * 1e3:.1f} ms p99 {pct(gaps, .99) * 1e3:.1f} ms", flush=True)
            ratios.append((n, rate / ref_rate))
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        with ray_engine("reference_lm", {"seed": 0, "dim": 16, "heads": 2, "layers": 1, "vocab": 32}, 1) as tiny:
            overhead = peak_rss_mb(tiny.replica_status()[0].pids[0])
        results = {}
        for tp in (1, 2):
            start = time.perf_counter()
            with ray_engine("hf_causal_lm", args, tp) as engine:
                load_s = time.perf_counter() - start
                pids = engine.replica_status()[0].pids
                loaded = [peak_rss_mb(p) for p in pids]
                engine_many(engine, prompts(sizes[0]), 2)
                runs = sorted(engine_many(engine, prompts(sizes[0]), opts.tokens)[0] for _ in range(REPEATS))
                seconds = runs[REPEATS // 2]
                served = [peak_rss_mb(p) for p in pids]
            results[tp] = (sizes[0] * opts.tokens / seconds, load_s, loaded)
            print(f"Ray group TP={tp}: {results[tp][0]:6.0f} tok/s at N={sizes[0]}  start (load) {load_s:5.1f} s  "
                  f"peak RSS per rank once loaded {', '.join(f'{r:.0f}' for r in loaded)} MB, after the requests "
                  f"{', '.join(f'{r:.0f}' for r in served)} MB", flush=True)
    finally:
        ray.shutdown()
    print(f"a rank's fixed overhead (peak RSS serving a 5k-parameter model): {overhead:.0f} MB; TP=1 weights "
          f"{weights_mb:.0f} MB")
    print("ratios:")
    for n, ratio in ratios:
        if n == 64:
            print(verdict(f"{n} one-prompt requests / transformers one padded batch", ratio, 1.5, True))
        else:
            print(f"  {n} one-prompt requests / transformers one padded batch{'':<9} {ratio:7.2f}x  (no target)")
    print(f"  TP=2 tok/s / TP=1 tok/s (2 cores shared){'':<22} {results[2][0] / results[1][0]:7.2f}x  (no target)")
    budget = 0.6 * weights_mb + overhead
    print(verdict("TP=2 peak RSS per rank / (0.6 x TP=1 weights + overhead)", max(results[2][2]) / budget, 1.0,
                  False))


if __name__ == "__main__":
    main()
