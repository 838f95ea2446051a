"""World models: `diffusers_pipeline` batched per denoising step vs diffusers' own WanPipeline, side by side.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_world.py [--repeats 3] [--json out.json] [--skip-ray]
[--skip-cosmos3 | --only-cosmos3]`

A Wan-shaped transformer sized for a small CPU machine (diffusers' `WanTransformer3DModel`, dim 128,
4 heads, 4 layers; one forward of a 9-frame 64x64 request is tens of ms), the tiny VAE and text
encoder of tests/diffusers_folders.py, saved as a WanPipeline folder. Latents only (`output_type=
"latent"`) except where the decode is what is measured.

1. Throughput: 8 concurrent requests of 8 steps with CFG through the Engine (inline, one rank) vs
   WanPipeline called (a) once per request in sequence and (b) once with the 8 prompts as one batch,
   same seeds; at torch's default thread count AND with one thread. Targets: Engine >= 0.9x (b) in
   both, >= 1.2x (a). Completion times come from the futures' callbacks: the caller blocks, it never
   polls (a poll every 2 ms took a core from torch's threads). Each thread count gets an engine of
   its own, made after `torch.set_num_threads`: a thread keeps the OpenMP thread count it had when it
   first ran an op, so the loop thread of an engine made before would run on at the old count.
2. Mixed step counts (4, 8, 12, 16; two each): the 4-step requests' latency vs the 16-step ones'.
   Target <= 0.5x.
3. Stage stall: a 60-step stream's largest gap between steps, alone and while three 256x256
   requests are VAE-decoded on the decode stage; the growth vs one decode's time (timed apart).
   Target <= 0.5x.
4. Preview: a 4-step request sent 0.5 s after a 40-step one, at a per-step budget that holds one of
   them (the loop's admission policy is printed: turns per step take the 4-step request in); its
   latency vs the 40-step job's. Target <= 0.5x.
5. On Ray (gloo, one request): CFG over 2 ranks vs 1 rank (target <= 0.65x), Ulysses over 2 ranks
   (attention.cp_size=2) at 1,024 latent tokens vs 1 rank (target <= 0.75x); peak RSS per rank.
6. Cosmos3 (benchmarks/bench_cosmos3.py's `cosmos3_runs`, on a Cosmos3OmniPipeline folder of its own): 8
   concurrent requests, 4 text-to-video and 4 policy chunks, through the Engine vs Cosmos3OmniPipeline
   called once per request (target >= 1.2x); the policy chunk's latency among 8 robots vs alone
   (target <= 4x).
Prints the machine first; medians and p99 over `--repeats`; each ratio with its target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from phyai_ray import (AttentionParallelConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig,
                       OuterParallelConfig, ParallelConfig, WorkerSupervisorConfig)

PLUGIN = "phyai_ray.models.diffusers_pipeline:DiffusersPipelineEntry"
BASE = {"negative_prompt": "blurry", "height": 64, "width": 64, "num_frames": 9, "max_sequence_length": 16,
        "guidance_scale": 5.0}
LONG = {**BASE, "height": 256, "width": 256, "num_frames": 13}  # 4 x 16 x 16 = 1,024 latent tokens
PROMPTS = ("a robot arm picks up the red cube", "a dog runs left", "camera moves right slowly", "a cat runs fast")


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    load = os.getloadavg()
    return (f"{platform.node()}: {os.cpu_count()} cores ({cpu}), torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, load average {load[0]:.1f} (shared machine)")


def build_folder(root: Path) -> Path:
    """A WanPipeline folder with a Wan-shaped transformer of tens of ms per forward."""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    from tests.diffusers_folders import _perturb, _text_encoder, _tokenizer, _vae

    torch.manual_seed(0)
    tokenizer = _tokenizer()
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=64, ffn_dim=512,
                                        num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        rope_max_seq_len=64).eval()
    text_encoder, vae = _text_encoder(len(tokenizer)), _vae(False)
    gen = torch.Generator("cpu").manual_seed(0)
    for module in (text_encoder, transformer, vae):
        _perturb(module, gen)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=sched,
                transformer=transformer).save_pretrained(root)
    return root


def requests(n: int, steps: int | list[int], base: dict = BASE) -> list[dict[str, Any]]:
    counts = steps if isinstance(steps, list) else [steps] * n
    return [{**base, "prompt": PROMPTS[i % len(PROMPTS)], "num_inference_steps": counts[i], "seed": i,
             "output_type": "latent"} for i in range(n)]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def timed(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return {"median_s": statistics.median(runs), "p99_s": p99(runs)}


def diffusers_runs(pipe: Any, batch: list[dict]) -> tuple[Callable, Callable]:
    """(a) one call per request in sequence, (b) one call with every prompt, the same seeds."""
    def call(rs: list[dict]) -> Any:
        first = rs[0]
        kwargs = {k: first[k] for k in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale",
                                        "max_sequence_length")}
        with torch.no_grad():
            return pipe(prompt=[r["prompt"] for r in rs], negative_prompt=[r["negative_prompt"] for r in rs],
                        generator=[torch.Generator("cpu").manual_seed(r["seed"]) for r in rs],
                        output_type="latent", **kwargs).frames

    return (lambda: [call([r]) for r in batch]), (lambda: call(batch))


def engine_run(engine: Engine, batch: list[dict]) -> list[float]:
    """Submit every request at once; each one's latency in seconds, stamped by its future's callback
    while this thread blocks on the results (a polling caller would take a core from torch's threads)."""
    start = time.perf_counter()
    ends: dict[int, float] = {}
    futures = []
    for i, r in enumerate(batch):
        future = engine.submit(r)
        future.add_done_callback(lambda _, i=i: ends.setdefault(i, time.perf_counter()))
        futures.append(future)
    for future in futures:
        future.result(timeout=600)
    while len(ends) < len(futures):  # the callbacks run on the engine's delivery thread, just after
        time.sleep(0.001)
    return [ends[i] - start for i in range(len(futures))]


def throughput(pipe: Any, engine: Engine, repeats: int, n: int = 8) -> dict[str, Any]:
    """N concurrent requests through the engine vs diffusers' one N-prompt call, the two alternating run
    by run (on a shared machine the load drifts between blocks of runs); the ratio is the median of
    each pair's; diffusers once per request timed apart."""
    batch = requests(n, 8)
    sequential, one_call = diffusers_runs(pipe, batch)
    engine_run(engine, batch), one_call()  # warm-up
    pairs = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine_run(engine, batch)
        middle = time.perf_counter()
        one_call()
        pairs.append((middle - start, time.perf_counter() - middle))
    ours, theirs = [a for a, _ in pairs], [b for _, b in pairs]
    rows = {"threads": torch.get_num_threads(), "engine": {"median_s": statistics.median(ours), "p99_s": p99(ours)},
            "diffusers_one_batch": {"median_s": statistics.median(theirs), "p99_s": p99(theirs)},
            "diffusers_sequential": timed(sequential, max(1, repeats // 2))}
    got = engine.step(batch[0])["video"]
    rows["max_abs_diff_vs_diffusers"] = float((got - torch.as_tensor(one_call()[0])).abs().max())
    rows["vs_one_batch"] = statistics.median(b / a for a, b in pairs)
    rows["vs_sequential"] = rows["diffusers_sequential"]["median_s"] / rows["engine"]["median_s"]
    print(f"N={n}, 8 steps, CFG, {rows['threads']} torch thread(s): engine {rows['engine']['median_s']:.2f}s (p99 "
          f"{rows['engine']['p99_s']:.2f}), diffusers one batch {rows['diffusers_one_batch']['median_s']:.2f}s, per "
          f"request {rows['diffusers_sequential']['median_s']:.2f}s; throughput vs one batch "
          f"{rows['vs_one_batch']:.2f}x (median of {repeats} alternating pairs; target >= 0.9), vs per request "
          f"{rows['vs_sequential']:.2f}x (target >= 1.2); |latents - diffusers| "
          f"{rows['max_abs_diff_vs_diffusers']:.1e}", flush=True)
    return rows


def mixed(engine: Engine, repeats: int) -> dict[str, Any]:
    steps = [4, 8, 12, 16] * 2
    shorts, longs = [], []
    engine_run(engine, requests(8, steps))
    for _ in range(repeats):
        latency = engine_run(engine, requests(8, steps))
        shorts += [t for t, s in zip(latency, steps) if s == 4]
        longs.append(max(t for t, s in zip(latency, steps) if s == 16))
    row = {"short_4_median_s": statistics.median(shorts), "short_4_p99_s": p99(shorts),
           "long_16_median_s": statistics.median(longs)}
    row["ratio"] = row["short_4_median_s"] / row["long_16_median_s"]
    print(f"mixed 4/8/12/16 steps (8 requests): 4-step latency {row['short_4_median_s']:.2f}s (p99 "
          f"{row['short_4_p99_s']:.2f}) vs the 16-step ones {row['long_16_median_s']:.2f}s: {row['ratio']:.2f}x "
          "(target <= 0.5)", flush=True)
    return row


def decode_time(pipe: Any, latents: torch.Tensor, repeats: int) -> dict[str, float]:
    z = latents[None].to(pipe.vae.dtype)
    with torch.no_grad():
        return timed(lambda: pipe.vae.decode(z, return_dict=False), repeats)


def peak_rss_mib(engine: Engine) -> list[float]:
    """VmHWM of every rank process of replica 0 (this process for an inline engine)."""
    out = []
    for pid in engine._executors[0].pids():
        status = Path(f"/proc/{pid}/status").read_text()
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
        out.append(round(kib / 1024, 1))
    return out


def ray_group(folder: Path, parallel: ParallelConfig) -> Engine:
    args = EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder)},
                      config=EngineConfig(device=DeviceConfig(target="cpu"), parallel=parallel))
    return Engine(args, DeploymentConfig.local(cpus_per_rank=0.5,
                                               process_config=WorkerSupervisorConfig(execution_timeout_s=600)))


def parallel_runs(folder: Path, repeats: int) -> dict[str, Any]:
    layouts = {"1 rank": ParallelConfig(), "CFG 2": ParallelConfig(outer=OuterParallelConfig(cfg_size=2)),
               "Ulysses 2": ParallelConfig(attention=AttentionParallelConfig(cp_size=2))}
    cases = {"cfg": requests(1, 8)[0], "ulysses": requests(1, 4, LONG)[0]}
    out: dict[str, Any] = {}
    for name, parallel in layouts.items():
        with ray_group(folder, parallel) as engine:
            row: dict[str, Any] = {}
            for case, request in cases.items():
                if (name, case) in (("CFG 2", "ulysses"), ("Ulysses 2", "cfg")):
                    continue
                row[case] = timed(lambda: engine.step(request, timeout=600), repeats)
            row["peak_rss_mib_per_rank"] = peak_rss_mib(engine)
        out[name] = row
        print(f"Ray {name}: " + ", ".join(f"{c} {v['median_s']:.2f}s (p99 {v['p99_s']:.2f})"
                                          for c, v in row.items() if isinstance(v, dict))
              + f"; peak RSS per rank {row['peak_rss_mib_per_rank']} MiB", flush=True)
    out["cfg2_ratio"] = out["CFG 2"]["cfg"]["median_s"] / out["1 rank"]["cfg"]["median_s"]
    out["ulysses2_ratio"] = out["Ulysses 2"]["ulysses"]["median_s"] / out["1 rank"]["ulysses"]["median_s"]
    print(f"CFG over 2 ranks / 1 rank (one request, 8 steps): {out['cfg2_ratio']:.2f}x (target <= 0.65); "
          f"Ulysses over 2 ranks / 1 rank (1,024 tokens, 4 steps): {out['ulysses2_ratio']:.2f}x (target <= 0.75)")
    return out


def stream_times(engine: Engine, request: dict, during: Callable[[int], None] | None = None) -> list[float]:
    """perf_counter when each step of a streamed request arrived; `during(k)` runs after its k-th step."""
    times = []
    for item in engine.stream(request, timeout=600):
        times.append(time.perf_counter())
        if during is not None:
            during(len(times))
    return times[:-1]  # the last item is the result, not a step


def stage_stall(engine: Engine, decode_s: float, repeats: int) -> dict[str, Any]:
    """A 60-step stream alone, then again while three 13x256x256 requests (2 steps, float video) are
    submitted at its 5th step and decoded on the decode stage: its largest step gap in both, and the
    growth against one decode's time (`decode_s`, timed apart). The decode windows come from the
    rank's own records (`stage_log`), so a gap counts as "while others decode" only if it overlaps one."""
    stream = {**requests(1, 60)[0], "guidance_scale": 1.0}
    others = [{**r, "output_type": "float"} for r in requests(3, 2, LONG)]
    alone, busy, decodes = [], [], []
    for _ in range(repeats):
        times = stream_times(engine, stream)
        alone.append(max(b - a for a, b in zip(times, times[1:])))
        futures: list[Any] = []
        times = stream_times(engine, stream, lambda k: futures.extend(engine.submit(r) for r in others) if k == 5 else None)
        for future in futures:
            future.result(timeout=600)
        log = engine.collective_rpc("stage_log", replica=0)
        windows = [(t0, t1) for what, _, _, t0, t1 in log if what == "decode" and t0 >= times[0]]
        decodes += [t1 - t0 for t0, t1 in windows]
        gaps = [b - a for a, b in zip(times, times[1:]) if any(a < t1 and t0 < b for t0, t1 in windows)]
        busy.append(max(gaps) if gaps else 0.0)
    row = {"largest_gap_alone_s": statistics.median(alone), "largest_gap_while_decoding_s": statistics.median(busy),
           "decode_apart_s": decode_s, "decode_on_stage_median_s": statistics.median(decodes) if decodes else None}
    row["growth_vs_decode"] = (row["largest_gap_while_decoding_s"] - row["largest_gap_alone_s"]) / decode_s
    print(f"stage stall: a 60-step stream's largest step gap {row['largest_gap_alone_s'] * 1e3:.0f} ms alone, "
          f"{row['largest_gap_while_decoding_s'] * 1e3:.0f} ms while 3 other requests decode (one decode "
          f"{decode_s * 1e3:.0f} ms apart, {(row['decode_on_stage_median_s'] or 0) * 1e3:.0f} ms on the decode stage): "
          f"growth {row['growth_vs_decode']:.2f}x a decode (target <= 0.5)", flush=True)
    return row


def loop_policy(engine: Engine) -> str:
    """The admission policy replica 0's iteration loop runs (found by its attribute name)."""
    seen, todo = set(), [engine._executors[0]]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        if type(obj).__name__ == "IterationLoop":
            return repr(obj.policy)
        todo += [v for v in vars(obj).values() if hasattr(v, "__dict__") and type(v).__module__.startswith("phyai")]
    return "(not found)"


def preview(folder: Path, repeats: int) -> dict[str, Any]:
    """A 4-step request 0.5 s after a 40-step one, at a per-step budget of one request: its latency vs
    the 40-step job's."""
    from phyai_ray.models.diffusers_pipeline import DiffusersPipelineEntry

    long, short = requests(1, 40)[0], {**requests(1, 4)[0], "prompt": "a cat runs fast", "seed": 9}
    budget = DiffusersPipelineEntry({"model": str(folder)}).sequences(long)[0].cost
    args = EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder), "max_latent_tokens_per_step": budget})
    ratios, shorts = [], []
    with Engine(args) as engine:
        policy = loop_policy(engine)
        engine.step(requests(1, 2)[0])  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            job = engine.submit(long)
            time.sleep(0.5)
            sent = time.perf_counter()
            quick = engine.submit(short)
            quick.result(timeout=600)
            shorts.append(time.perf_counter() - sent)
            job.result(timeout=600)
            ratios.append(shorts[-1] / (time.perf_counter() - start))
    row = {"short_4_latency_s": statistics.median(shorts), "ratio": statistics.median(ratios), "budget": budget,
           "policy": policy}
    print(f"preview: a 4-step request sent 0.5 s after a 40-step job (per-step budget {budget} latent tokens = one "
          f"request; admission {policy}): {row['short_4_latency_s']:.2f}s, {row['ratio']:.2f}x the job's time "
          "(target <= 0.5)", flush=True)
    return row


def inline_runs(folder: Path, results: dict[str, Any], repeats: int, threads: list[int]) -> None:
    """Parts 1-4 (one inline rank) against WanPipeline in this process; the VAE decode timed apart."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    args = EngineArgs(plugin=PLUGIN, plugin_args={"model": str(folder), "max_latent_tokens_per_step": 1 << 20})
    results["throughput"] = {}
    for count in threads:  # a new engine per count: a thread keeps the torch thread count it started with
        torch.set_num_threads(count)
        with Engine(args) as engine:
            results["throughput"][f"threads={count}"] = throughput(pipe, engine, repeats)
    torch.set_num_threads(threads[0])
    with Engine(args) as engine:
        results["mixed_steps"] = mixed(engine, repeats)
        long = engine.step({**requests(1, 2, LONG)[0]})["video"]
        results["vae_decode_one_request"] = decode_time(pipe, long, repeats)
        print(f"VAE decode of one 13x256x256 request (timed apart): "
              f"{results['vae_decode_one_request']['median_s']:.3f}s", flush=True)
        results["stage_stall"] = stage_stall(engine, results["vae_decode_one_request"]["median_s"], repeats)
        results["peak_rss_mib_inline"] = peak_rss_mib(engine)
    results["preview"] = preview(folder, repeats)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-ray", action="store_true", help="leave out the CFG / Ulysses runs on Ray")
    parser.add_argument("--only-ray", action="store_true", help="the CFG / Ulysses runs on Ray alone")
    parser.add_argument("--skip-cosmos3", action="store_true", help="leave out part 6 (Cosmos3)")
    parser.add_argument("--only-cosmos3", action="store_true", help="part 6 (Cosmos3) alone")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="torch thread counts to measure "
                        "throughput at (default: torch's default, then 1)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    opts = parser.parse_args(argv)
    threads = opts.threads or [torch.get_num_threads(), 1]
    results: dict[str, Any] = {"machine": machine()}
    print(f"machine: {results['machine']}", flush=True)
    if not opts.only_cosmos3:
        with tempfile.TemporaryDirectory() as tmp:
            folder = build_folder(Path(tmp) / "wan-bench")
            if not opts.only_ray:
                inline_runs(folder, results, opts.repeats, threads)
            if not opts.skip_ray:
                results["ray"] = parallel_runs(folder, opts.repeats)
    if opts.only_cosmos3 or not (opts.skip_cosmos3 or opts.only_ray):
        results["cosmos3"] = cosmos3_part(opts.repeats)
    if opts.json is not None:
        write_json(opts.json, results)
    return results


def cosmos3_part(repeats: int) -> dict[str, Any]:
    """Part 6: bench_cosmos3.py's runs (they print their rows and record tables "cosmos3_throughput" and
    "cosmos3_robots" for `write_json`)."""
    import bench_cosmos3  # benchmarks/bench_cosmos3.py, beside this script

    print("Cosmos3 (bench_cosmos3.py, a Cosmos3OmniPipeline folder of hidden 128, 4 layers; 4 steps, CFG):",
          flush=True)
    return bench_cosmos3.cosmos3_runs(repeats)


def write_json(path: Path, results: dict[str, Any]) -> None:
    """The results as `benchmarks/results.py` files are (benchmark "world"), for benchmarks/plot.py; part 6's
    tables are recorded where it prints them."""
    import results as files  # benchmarks/results.py, beside this script

    for row in results.get("throughput", {}).values():
        files.record("throughput", n=8, threads=row["threads"], engine_s=row["engine"]["median_s"],
                     engine_p99_s=row["engine"]["p99_s"], diffusers_one_batch_s=row["diffusers_one_batch"]["median_s"],
                     diffusers_sequential_s=row["diffusers_sequential"]["median_s"],
                     max_abs_diff=row["max_abs_diff_vs_diffusers"])
    for name in ("mixed_steps", "stage_stall", "preview"):
        if name in results:
            files.record(name.split("_")[0] if name == "mixed_steps" else name,
                         **{k: v for k, v in results[name].items() if not isinstance(v, (list, dict))})
    for layout, row in results.get("ray", {}).items():
        if isinstance(row, dict):
            for case in ("cfg", "ulysses"):
                if case in row:
                    files.record("ray", layout=layout, case=case, median_s=row[case]["median_s"],
                                 p99_s=row[case]["p99_s"], peak_rss_mib=max(row["peak_rss_mib_per_rank"]))
    files.write(str(path), "world", results["machine"])


if __name__ == "__main__":
    main()
