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
5. GRPO-shaped rollouts (`--only grpo`): 16 prompts of 256-512 tokens x 8 samples of 64 tokens at
   temperature 1 (one request of 8 copies per prompt, all submitted at once), through an inline engine
   with automatic prefix caching on and one with it off, against transformers'
   `generate(num_return_sequences=8)` on the same 16 prompts (one left-padded batch). Greedy and seeded
   runs check that caching changes no token. Target: caching on >= 2x caching off and >= 1.5x
   transformers.
6. A long prompt joining decoders (`--only mixed`, a TP=1 Ray group, its rank's VmHWM): 32 sequences
   decode; once they run, one 2,000-token prompt joins. Against the same run without it: the rank's
   peak RSS grows by no more than the prompt's own KV plus one iteration's activations (the plugin's
   `max_num_batched_tokens`: CHUNK tokens, so its prefill takes several iterations), and the
   decoders' inter-token p99 while it prefills stays <= 3x their p50. CHUNK is 64: the 32 decodes
   come first, so each iteration carries 32 of the prompt's tokens; on a CPU an iteration's time
   grows with its tokens (at 128, i.e. 96 prompt tokens beside 32 decodes, the p99 read 4.1x).
7. Cascade precision (`--only cascade`): bfloat16, 8 rows sharing 2,016 prefix keys + 32 own each
   (2,048 keys, d 128): the cascade kernel's relative error against float64 over SDPA's own on the
   same bfloat16 inputs (target <= 1.5x).
8. Decode memory (`--only memory`): 64 decode rows of mixed lengths (16..2,048 tokens, 8 kv heads of
   128, block 16) over a paged pool: the peak of the tensors one decode attention call allocates
   (an aten-level dispatch mode adds every new storage and subtracts it when freed), over the KV
   bytes the rows read (target <= 1.2x), beside the padded copy it replaced.
9. Fleet update (`--only fleet`): `--fleet-groups` Ray groups of TP=`--fleet-tp` (default 4 x 2) of
   this checkpoint under steady requests; `WeightSender.update(groups, params, version)` stages,
   verifies and switches them: the pause (no replica serving), the staging (transfer into every
   rank), and the verification (sender's sha256 plus the slowest rank's) over the staging (target
   <= 1x the transfer).
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
from phyai_ray import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig,  # noqa: E402
                       DeviceConfig, Engine, EngineArgs, EngineConfig, ParallelConfig, WorkerSupervisorConfig)

REPEATS = 3
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=16384, max_position_embeddings=2304, tie_word_embeddings=False)
GRPO_PROMPTS, GRPO_SAMPLES, GRPO_TOKENS = 16, 8, 64
GRPO_CACHE = 640 << 20  # room for all 128 sequences unshared, so caching off never waits for blocks
LONG_PROMPT, DECODERS, DECODE_TOKENS, CHUNK = 2000, 32, 160, 64


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


def alternated(engine: Engine, reference: Any, batch: list[list[int]], tokens: int,
               repeats: int = REPEATS) -> tuple[float, float, int]:
    """The engine's and transformers' tokens/s on `batch` (runs alternated, the median of `repeats` each),
    and how many prompts got equal tokens."""
    ours, theirs = [], []
    for _ in range(repeats):
        seconds, our_tokens = engine_many(engine, batch, tokens)
        ours.append(seconds)
        seconds, their_tokens = transformers_batch(reference, batch, tokens)
        theirs.append(seconds)
    n = len(batch)
    same = sum(a == b for a, b in zip(our_tokens, their_tokens))
    return n * tokens / sorted(ours)[repeats // 2], n * tokens / sorted(theirs)[repeats // 2], same


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


def grpo_prompts() -> list[list[int]]:
    """16 random prompts of 256..496 tokens (no EOS concerns: generation ignores it)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, SHAPE["vocab_size"], (256 + 16 * i,), generator=g).tolist()
            for i in range(GRPO_PROMPTS)]


def rollouts(engine: Engine, batch: list[list[int]], tokens: int, **sampling: Any) -> tuple[float, list]:
    """Each prompt as one request of GRPO_SAMPLES copies, all at once: (seconds, [[tokens] * samples])."""
    start = time.perf_counter()
    futures = [engine.submit({"prompts": [p] * GRPO_SAMPLES, "max_tokens": tokens, "ignore_eos": True, **sampling})
               for p in batch]
    outs = [[o.token_ids for o in f.result(timeout=3600)] for f in futures]
    return time.perf_counter() - start, outs


def transformers_grpo(model: Any, batch: list[list[int]], tokens: int) -> float:
    """transformers' own way: ONE left-padded batch, generate(num_return_sequences=GRPO_SAMPLES)."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                       temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=GRPO_SAMPLES, pad_token_id=0,
                       eos_token_id=None)
    return time.perf_counter() - start


def part_grpo(folder: Path, reference: Any) -> list[str]:
    batch = grpo_prompts()
    rollout_tokens = GRPO_PROMPTS * GRPO_SAMPLES * GRPO_TOKENS
    greedy, seeded, seconds, unseeded = {}, {}, {}, []
    for on in (True, False):  # one engine at a time: an idle engine's threads never share the cores
        with Engine(EngineArgs(plugin="hf_causal_lm", config=EngineConfig(device=DeviceConfig(target="cpu")),
                               plugin_args={"model": str(folder), "max_model_len": 640, "kv_cache_bytes": GRPO_CACHE,
                                            "enable_prefix_caching": on})) as engine:
            rollouts(engine, batch[:2], 4)  # warm-up, then the equality checks (short runs)
            greedy[on] = rollouts(engine, batch[:4], 16)[1]
            seeded[on] = rollouts(engine, batch[:4], 16, temperature=1.0, seed=7)[1]
            engine.collective_rpc("reset_cache")  # the timed run starts with no prompt cached
            before = engine.collective_rpc("prefix_cache_stats")[0]
            seconds[on] = rollouts(engine, batch, GRPO_TOKENS, temperature=1.0)[0]
            stats = engine.collective_rpc("prefix_cache_stats")[0]
            print(f"  prefix caching {'on ' if on else 'off'}: {seconds[on]:.1f} s, prompt tokens reused "
                  f"{stats['hits'] - before['hits']} of {stats['queries'] - before['queries']} looked up", flush=True)
            if on:
                unseeded = rollouts(engine, batch[:2], 16, temperature=1.0)[1]
    theirs = transformers_grpo(reference, batch, GRPO_TOKENS)
    rate = {on: rollout_tokens / s for on, s in seconds.items()}
    distinct = min(len({tuple(t) for t in samples}) for samples in unseeded)
    print(f"GRPO-shaped ({GRPO_PROMPTS} prompts of 256-496 tokens x {GRPO_SAMPLES} samples x {GRPO_TOKENS} tokens, "
          f"temperature 1): prefix caching on {rate[True]:6.0f} tok/s ({seconds[True]:.1f} s)  off {rate[False]:6.0f} "
          f"tok/s ({seconds[False]:.1f} s)  transformers num_return_sequences {rollout_tokens / theirs:6.0f} tok/s "
          f"({theirs:.1f} s) | greedy equal on/off: {greedy[True] == greedy[False]}  seeded equal on/off: "
          f"{seeded[True] == seeded[False]}  distinct unseeded samples per prompt: >= {distinct}/{GRPO_SAMPLES}",
          flush=True)
    return [verdict("GRPO: prefix caching on / off", rate[True] / rate[False], 2.0, True),
            verdict("GRPO: prefix caching on / transformers num_return_sequences", rate[True] * theirs / rollout_tokens,
                    1.5, True)]


def decoders_beside(engine: Engine, long_prompt: list[int] | None) -> tuple[list[float], list[float], float]:
    """32 streamed decoders; once each has 8 tokens the long prompt (if any) joins. Returns the decoders'
    inter-token gaps that overlap the long prompt's prefill, the other gaps, and its time to its token."""
    arrivals: list[list[float]] = [[] for _ in range(DECODERS)]
    started = threading.Barrier(DECODERS + 1, timeout=600)
    window = [float("inf"), float("-inf")]

    def read(i: int, prompt: list[int]) -> None:
        for chunk in engine.stream(request(prompt, DECODE_TOKENS)):
            if chunk["token_ids"][0] is not None:
                arrivals[i].append(time.perf_counter())
                if len(arrivals[i]) == 8:
                    started.wait()

    threads = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(prompts(DECODERS))]
    for t in threads:
        t.start()
    started.wait()
    if long_prompt is not None:
        window[0] = time.perf_counter()
        engine.submit(request(long_prompt, 1)).result(timeout=1200)
        window[1] = time.perf_counter()
    for t in threads:
        t.join(1200)
    inside, outside = [], []
    for times in arrivals:
        for a, b in zip(times, times[1:]):
            (inside if b > window[0] and a < window[1] else outside).append(b - a)
    return inside, outside, window[1] - window[0]


def part_mixed(folder: Path) -> list[str]:
    import ray

    args = {"model": str(folder), "max_model_len": LONG_PROMPT + 64, "max_num_batched_tokens": CHUNK}
    long_prompt = [(13 * j + 5) % SHAPE["vocab_size"] for j in range(LONG_PROMPT)]
    runs = {}
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        for joined in (False, True):
            with ray_engine("hf_causal_lm", args, 1) as engine:
                pid = engine.replica_status()[0].pids[0]
                engine_many(engine, prompts(4), 4)
                inside, outside, prefill_s = decoders_beside(engine, long_prompt if joined else None)
                runs[joined] = (peak_rss_mb(pid), inside, outside, prefill_s)
    finally:
        ray.shutdown()
    a = SHAPE
    head_dim = a["hidden_size"] // a["num_attention_heads"]
    kv_mb = LONG_PROMPT * a["num_hidden_layers"] * 2 * a["num_key_value_heads"] * head_dim * 4 / 2 ** 20
    budget = CHUNK
    qkv = (a["num_attention_heads"] + 2 * a["num_key_value_heads"]) * head_dim
    width = 3 * a["hidden_size"] + 2 * a["intermediate_size"] + qkv  # per token: norms, q/k/v, MLP
    act_mb = budget * width * 4 / 2 ** 20
    grown = runs[True][0] - runs[False][0]
    _, inside, outside, prefill_s = runs[True]
    p50 = pct(outside + inside, .5)
    print(f"{LONG_PROMPT}-token prompt joining {DECODERS} decoders: peak RSS {runs[False][0]:.0f} MB without it, "
          f"{runs[True][0]:.0f} MB with it (+{grown:.0f} MB; its KV {kv_mb:.0f} MB + one iteration's activations at "
          f"{budget} tokens {act_mb:.0f} MB); its prefill {prefill_s * 1e3:.0f} ms; decoders' inter-token p50 "
          f"{p50 * 1e3:.1f} ms, p99 during its prefill {pct(inside, .99) * 1e3:.1f} ms ({len(inside)} gaps), "
          f"p50 / p99 without it {pct(runs[False][2], .5) * 1e3:.1f} / {pct(runs[False][2], .99) * 1e3:.1f} ms",
          flush=True)
    return [verdict("long prompt: peak RSS growth / (its KV + one iteration of activations)", grown / (kv_mb + act_mb),
                    1.0, False),
            verdict("long prompt: decoders' inter-token p99 during its prefill / p50", pct(inside, .99) / p50, 3.0,
                    False)]


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="64,256")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--only", choices=("throughput", "grpo", "mixed", "cascade", "memory", "fleet"),
                        help="run one part only")
    parser.add_argument("--fleet-groups", type=int, default=4)
    parser.add_argument("--fleet-tp", type=int, default=2)
    opts = parser.parse_args(argv)
    print(machine(), flush=True)
    lines = []
    if opts.only in (None, "cascade"):
        lines += part_cascade()
    if opts.only in (None, "memory"):
        lines += part_decode_memory()
    if opts.only in ("cascade", "memory"):
        print("ratios:", *lines, sep="\n")
        return
    folder = Path(tempfile.mkdtemp(prefix="bench-hf-")) / "qwen2-bench"
    params = write_checkpoint(folder)
    print(f"checkpoint: Qwen2-shaped, {params / 1e6:.1f}M parameters, {params * 4 / 2 ** 20:.0f} MB fp32, in {folder}",
          flush=True)
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if opts.only in (None, "throughput"):
        lines += part_throughput(folder, reference, params, [int(n) for n in opts.requests.split(",")], opts.tokens)
    if opts.only in (None, "grpo"):
        lines += part_grpo(folder, reference)
    if opts.only in (None, "mixed"):
        lines += part_mixed(folder)
    if opts.only in (None, "fleet"):
        lines += part_fleet(folder, reference, opts.fleet_groups, opts.fleet_tp)
    print("ratios:")
    for line in lines:
        print(line)


def part_throughput(folder: Path, reference: Any, params: int, sizes: list[int], tokens: int) -> list[str]:
    import ray

    weights_mb = params * 4 / 2 ** 20
    args = {"model": str(folder), "max_model_len": 512}
    ratios = []
    with Engine(EngineArgs(plugin="hf_causal_lm", plugin_args=args,
                           config=EngineConfig(device=DeviceConfig(target="cpu")))) as engine:
        engine_many(engine, prompts(4), 4)  # warm-up
        for n in sizes:
            batch = prompts(n)
            engine_many(engine, batch, 2)  # the KV cache grows to N rows once, outside the timed runs
            rate, ref_rate, same = alternated(engine, reference, batch, tokens)
            ttft, gaps = streamed(engine, batch, tokens)
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
                runs = sorted(engine_many(engine, prompts(sizes[0]), tokens)[0] for _ in range(REPEATS))
                seconds = runs[REPEATS // 2]
                served = [peak_rss_mb(p) for p in pids]
            results[tp] = (sizes[0] * tokens / seconds, load_s, loaded)
            print(f"Ray group TP={tp}: {results[tp][0]:6.0f} tok/s at N={sizes[0]}  start (load) {load_s:5.1f} s  "
                  f"peak RSS per rank once loaded {', '.join(f'{r:.0f}' for r in loaded)} MB, after the requests "
                  f"{', '.join(f'{r:.0f}' for r in served)} MB", flush=True)
    finally:
        ray.shutdown()
    print(f"a rank's fixed overhead (peak RSS serving a 5k-parameter model): {overhead:.0f} MB; TP=1 weights "
          f"{weights_mb:.0f} MB")
    lines = []
    for n, ratio in ratios:
        if n == 64:
            lines.append(verdict(f"{n} one-prompt requests / transformers one padded batch", ratio, 1.5, True))
        else:
            lines.append(f"  {n} one-prompt requests / transformers one padded batch{'':<9} {ratio:7.2f}x  (no target)")
    tp_ratio = results[2][0] / results[1][0]
    lines.append(f"  TP=2 tok/s / TP=1 tok/s (2 cores shared){'':<22} {tp_ratio:7.2f}x  (no target)")
    budget = 0.6 * weights_mb + overhead
    lines.append(verdict("TP=2 peak RSS per rank / (0.6 x TP=1 weights + overhead)", max(results[2][2]) / budget,
                         1.0, False))
    return lines


def part_cascade() -> list[str]:
    import torch.nn.functional as F

    from phyai_ray.nn.attention import cascade_attention

    g = torch.Generator().manual_seed(0)
    rows, heads, kv, d, prefix, own = 8, 4, 2, 128, 2016, 32
    q = torch.randn(rows, heads, d, generator=g).bfloat16()
    pk, pv = (torch.randn(1, kv, prefix, d, generator=g).bfloat16() for _ in range(2))
    ok, ov = (torch.randn(rows, kv, own, d, generator=g).bfloat16() for _ in range(2))
    out = cascade_attention(q, ok, ov, torch.ones(rows, 1, 1, own, dtype=torch.bool), [(torch.arange(rows), pk, pv)])
    keys = torch.cat([pk.expand(rows, -1, -1, -1), ok], 2).repeat_interleave(heads // kv, 1)
    values = torch.cat([pv.expand(rows, -1, -1, -1), ov], 2).repeat_interleave(heads // kv, 1)

    def sdpa(dtype: torch.dtype) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.to(dtype)[:, :, None], keys.to(dtype), values.to(dtype))[:, :, 0]

    exact = sdpa(torch.float64)
    ours, theirs = ((o.double() - exact).norm().item() / exact.norm().item() for o in (out, sdpa(torch.bfloat16)))
    print(f"cascade in bfloat16 at 2,048 keys: relative error {ours:.2e} (SDPA on the same inputs {theirs:.2e})")
    return [verdict("cascade error / SDPA's error (bf16, 2,048 keys)", ours / theirs, 1.5, False)]


class PeakTensors:
    """The peak bytes of tensors allocated inside a `with` block (aten-level, freed ones subtracted)."""

    def __enter__(self) -> "PeakTensors":
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        outer = self
        self.live = self.peak = 0
        self.seen: set[int] = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in outer.seen:
                        ptr, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                        outer.seen.add(ptr)
                        outer.live += size
                        outer.peak = max(outer.peak, outer.live)
                        weakref.finalize(t, outer.freed, ptr, size)
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def freed(self, ptr: int, size: int) -> None:
        self.seen.discard(ptr)
        self.live -= size

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def part_decode_memory() -> list[str]:
    from phyai_ray.nn.attention import decode_attention, paged_decode_attention

    rows, heads, kv, d, bs = 64, 32, 8, 128, 16
    lengths = [16 + (i * 977) % 2033 for i in range(rows)]
    tables, start = [], 1
    for n in lengths:
        tables.append(list(range(start, start + -(-n // bs))))
        start += len(tables[-1])
    keys, values = (torch.randn(start, bs, kv, d, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(rows, heads, d, dtype=torch.bfloat16)
    blocks = torch.tensor([b for t in tables for b in t])
    owner = torch.tensor([i for i, t in enumerate(tables) for _ in t])
    valid = torch.arange(bs)[None, :] < torch.tensor([n - j * bs for n, t in zip(lengths, tables)
                                                       for j in range(len(t))])[:, None]
    read = 2 * blocks.numel() * bs * kv * d * 2
    with PeakTensors() as paged:
        paged_decode_attention(q, keys, values, blocks, owner, valid)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    visible = (torch.arange(width * bs)[None, :] < torch.tensor(lengths)[:, None]).view(rows, 1, 1, -1)
    with PeakTensors() as padded:
        k = keys[table].view(rows, width * bs, kv, d).transpose(1, 2)
        v = values[table].view(rows, width * bs, kv, d).transpose(1, 2)
        decode_attention(q, k, v, visible)
        del k, v
    print(f"decode attention, 64 rows of 16..2,048 tokens (bf16, 8 kv heads x 128): KV read {read / 2 ** 20:.0f} MiB; "
          f"peak allocated over blocks {paged.peak / 2 ** 20:.0f} MiB, as a padded copy {padded.peak / 2 ** 20:.0f} MiB")
    return [verdict("decode attention peak / the KV it reads (over blocks)", paged.peak / read, 1.2, False),
            f"  decode attention peak / the KV it reads (padded copy){'':<12} {padded.peak / read:7.2f}x  (no target)"]


def part_fleet(folder: Path, reference: Any, groups: int, tp: int) -> list[str]:
    import ray

    from phyai_ray import WeightSender

    ray.init(num_cpus=max(8, groups * tp), include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        engines = [ray_engine("hf_causal_lm", {"model": str(folder), "max_model_len": 512}, tp) for _ in range(groups)]
        sender, stop = WeightSender(), threading.Event()
        sender.update(engines, reference.named_parameters(), version=1)

        def steady(engine: Engine) -> None:
            while not stop.is_set():
                engine.step(request(prompts(1)[0], 8))

        threads = [threading.Thread(target=steady, args=(e,), daemon=True) for e in engines]
        for t in threads:
            t.start()
        reports = [sender.update(engines, reference.named_parameters(), version=v) for v in (2, 3, 4)]
        stop.set()
        for t in threads:
            t.join(120)
        for e in engines:
            e.close()
    finally:
        ray.shutdown()
    r = sorted(reports, key=lambda x: x.pause_s)[1]
    print(f"fleet update, {groups} groups x TP={tp}, {r.bytes_sent / 2 ** 20:.0f} MiB (median of 3): staging "
          f"{r.stage_s:.2f} s, verify {r.verify_s:.2f} s, pause {r.pause_s * 1e3:.0f} ms", flush=True)
    return [verdict("fleet verify / transfer (staging)", r.verify_s / r.stage_s, 1.0, False),
            f"  fleet pause (no replica serving){'':<30} {r.pause_s * 1e3:7.0f} ms (no target)"]


if __name__ == "__main__":
    main()
