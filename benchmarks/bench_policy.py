"""Robot policies: a pi0-shaped `lerobot_policy` batched per expert step vs LeRobot's own pi0, side by side.

Run: `flock /tmp/phyai-ray-tests.lock timeout 900 env PYTHONPATH=. .venv/bin/python benchmarks/bench_policy.py
[--rounds 4] [--seconds 8] [--no-openpi] [--json out.json]`

The policy: pi0's layout (chunk 50, 10 steps, 32-wide state and action, two cameras, 48 prompt tokens)
narrowed to a chunk of tens of ms on a small CPU; LeRobot 0.4.4 writes it and loads it back in its
venv (scripts/lerobot_reference/bench_reference.py; `make lerobot-reference`); phyai-ray serves that folder.

1. Parity: robot 0's chunk from both, the same noise (max |difference|).
2. Where a frame's time goes (the plugin's model called directly): the prefix pass of one frame and of
   8 frames as one pass, one expert step for 1, 8 and 16 frames. 2b: 8 robots arriving together,
   before (batch_prefixes=false: a VLM pass per frame) and after (the plan's prefixes in one pass),
   alternating: each robot's first-chunk latency, and the prefix passes the engine ran by size.
3. N = 8 and 16 robots whose frames arrive together: phyai-ray (inline engine, iteration protocol: each
   frame submitted, one expert step per iteration for all) vs LeRobot's predict_action_chunk (with its
   pre- and postprocessor) one robot at a time and all N as one batch; the sides alternate `--rounds`
   times so machine drift hits both. Throughput (chunks/s), each robot's frame latency vs a lone frame's.
4. openpi-client robots (the clients' venv of tests/client_venv.py) on a Serve app of the policy, via
   the group's direct ingress: one robot's non-model overhead per frame (round trip minus the server's
   infer_ms), then 8 robots at 20 Hz with 100 ms deadlines: the fraction on time, batch sizes.
5. Joins (bench_joins.py): a running robot's step gaps while 8 others join, prefixes whole vs prefix_budget.
Prints the machine first, medians and p99, ratios side by side, the issue's targets met or NOT MET.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import wait
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import results  # noqa: E402  (benchmarks/results.py, beside this script)
from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig  # noqa: E402

REFERENCE_PYTHON = Path(os.environ.get("LEROBOT_OPENPI_VENV", "/tmp/lerobot-openpi-venv")) / "bin" / "python"
REFERENCE_SCRIPT = ROOT / "scripts" / "lerobot_reference" / "bench_reference.py"
ROBOTS = Path(__file__).resolve().parent / "policy_robots.py"  # the openpi-client robots, run in the clients' venv
PLUGIN = "phyai_ray.models.lerobot_policy:LeRobotPolicyEntry"
CPU = EngineConfig(device=DeviceConfig(target="cpu"))
WAIT_S = 300.0  # the longest any one wait of this script may take
MARK = {True: "met", False: "NOT MET"}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return (f"machine: {platform.node()}, {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB; python "
            f"{platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} threads); load "
            f"average {os.getloadavg()[0]:.1f} at start (shared machine)")


def took(fn: Any) -> float:
    """Seconds fn() takes."""
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


class ReferenceProcess:
    """bench_reference.py in LeRobot's venv: it writes the folder, loads it, and answers commands."""

    def __init__(self, out: Path, threads: int) -> None:
        if not REFERENCE_PYTHON.exists():
            raise SystemExit(f"{REFERENCE_PYTHON} is missing: build LeRobot's reference venv with "
                             "`make lerobot-reference` (scripts/lerobot_reference/build_venv.sh)")
        self.log = open(out / "reference.log", "w")
        self.proc = subprocess.Popen([str(REFERENCE_PYTHON), str(REFERENCE_SCRIPT), "--out", str(out), "--threads",
                                      str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.meta = self._reply("writing and loading the pi0 folder")

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("BENCH_REF "):
                self.lines.put(json.loads(line[len("BENCH_REF "):]))
        self.lines.put(None)

    def _reply(self, what: str) -> dict:
        try:
            got = self.lines.get(timeout=WAIT_S)
        except queue.Empty:
            got = None
        if got is None:
            self.log.flush()
            raise RuntimeError(f"LeRobot's side gave no answer {what} within {WAIT_S:.0f}s (exit code "
                               f"{self.proc.poll()}); its log ends:\n{Path(self.log.name).read_text()[-3000:]}")
        return got

    def ask(self, **command: Any) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._reply(f"to {command}")

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


class Robots:
    """The robots' frames (LeRobot's keys, float CHW images in [0, 1]) as bench_reference.py wrote them."""

    def __init__(self, out: Path, meta: dict) -> None:
        self.t = load_file(str(out / "frames.safetensors"))
        self.prompts, self.cameras = meta["prompts"], meta["cameras"]

    def frame(self, r: int) -> dict:
        out = {"observation.state": self.t["state"][r], "task": self.prompts[r], "noise": self.t["noise"][r]}
        return {**out, **{key: self.t[key][r] for key in self.cameras}}

    def openpi_npz(self, path: Path, n: int) -> None:
        """uint8 HWC camera frames, states and prompts under the client script's names."""
        top, wrist = self.cameras
        arrays = {}
        for r in range(n):
            for name, key in (("image", top), ("wrist_image", wrist)):
                arrays[f"{name}_{r}"] = (self.t[key][r] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            arrays[f"state_{r}"], arrays[f"prompt_{r}"] = self.t["state"][r].numpy(), np.array(self.prompts[r])
        np.savez(path, **arrays)


def engine_batch(engine: Engine, robots: Robots, which: range) -> tuple[float, list[float]]:
    """Those robots' frames submitted together: (seconds until every chunk is back, each frame's latency in s,
    from its submission to its outcome)."""
    start = time.perf_counter()
    futures = [engine.submit(robots.frame(r)) for r in which]
    if (pending := wait(futures, timeout=WAIT_S)[1]):
        raise TimeoutError(f"{len(pending)} of {len(futures)} frames gave no chunk within {WAIT_S:.0f}s")
    [f.result() for f in futures]  # noqa: B018  (raises a frame's error)
    return time.perf_counter() - start, [f.finished - f.submitted for f in futures]


def split(args: dict, robots: Robots) -> dict[str, float]:
    """The plugin's model called directly (no engine): ms of the prefix pass (preprocessing and the VLM over
    images and prompt) of 1 frame and of 8 frames as one pass, and of one expert step for 1, 8 and 16 frames."""
    from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry

    entry = LeRobotPolicyEntry(args)
    model = entry.create(args, SimpleNamespace(device="cpu"))
    payloads = [entry.validate_request(robots.frame(r)) for r in range(16)]
    out = {f"prefix_{b}_ms": statistics.median(took(lambda: model.encode(payloads[:b])) for _ in range(5)) * 1e3
           for b in (1, 8)}
    for b in (1, 8, 16):
        steps = []
        for _ in range(3):
            for i in range(b):
                model.admit(i, payloads[i])
            model.iterate()  # the prefixes (one pass) and the first step
            steps += [took(model.iterate) for _ in range(9)]
        out[f"step_{b}_ms"] = statistics.median(steps) * 1e3
    return out


def prefixes_part(after: Engine, before: Engine, robots: Robots, rounds: int, lines: list[str]) -> dict:
    """8 robots' frames arriving together, the engine with batched prefix passes (`after`) and one with a pass
    per frame (`before`, batch_prefixes=false), alternating: each robot's first chunk and the last one (ms)."""
    got: dict[str, list[float]] = collections.defaultdict(list)
    passes = lambda: after.collective_rpc("prefix_stats", replica=0)  # noqa: E731
    seen = passes()
    for _ in range(rounds * 2):
        for name, engine in (("before", before), ("after", after)):
            wall, each = engine_batch(engine, robots, range(8))
            got[f"{name}_wall"].append(wall * 1e3)
            got[f"{name}_each"] += [e * 1e3 for e in each]
    sizes = {k: v - seen.get(k, 0) for k, v in passes().items() if v > seen.get(k, 0)}
    out = {f"{k}_{q}": pct(got[k], q) for k in got for q in (50, 99)}
    for name, what in (("before", "a prefix pass per frame"), ("after", "the plan's prefixes in one pass")):
        lines.append(f"  {what:32s}: each robot's chunk p50 {out[name + '_each_50']:6.1f}ms p99 "
                     f"{out[name + '_each_99']:6.1f}ms; all 8 back p50 {out[name + '_wall_50']:6.1f}ms")
    lines.append(f"  after / before: each robot p50 {out['after_each_50'] / out['before_each_50']:.2f}x, all 8 back "
                 f"{out['after_wall_50'] / out['before_wall_50']:.2f}x; prefix passes {{frames: passes}} {sizes}")
    results.record("prefix_batching", **out, pass_sizes=json.dumps(sizes))
    return out


def side_by_side(engine: Engine, robots: Robots, ref: ReferenceProcess, rounds: int) -> dict[str, list[float]]:
    """Both sides, alternating, `rounds` times: lone frames, then N = 8 and 16 (seconds)."""
    got: dict[str, list[float]] = collections.defaultdict(list)
    add = lambda key, values: got[key].extend(values)  # noqa: E731
    engine_batch(engine, robots, range(8))  # warm
    for r in range(rounds):
        for i in range(8):  # robots 0..7, each alone, as LeRobot's side below
            add("ours_lone", engine_batch(engine, robots, range(i, i + 1))[1])
        for n in (8, 16):
            for _ in range(2):
                wall, each = engine_batch(engine, robots, range(n))
                add(f"ours_wall_{n}", [wall])
                add(f"ours_each_{n}", each)
        alone = ref.ask(cmd="alone", n=16, repeats=1)
        add("ref_lone", alone["seconds"][:8])
        add("ref_lone_predict", alone["predict_seconds"][:8])
        add("ref_seq_8", [sum(alone["seconds"][:8])])
        add("ref_seq_16", [sum(alone["seconds"])])
        for n in (8, 16):
            batch = ref.ask(cmd="batch", n=n, repeats=2)
            add(f"ref_batch_{n}", batch["seconds"])
            add(f"ref_batch_predict_{n}", batch["predict_seconds"])
        print(f"  round {r + 1}/{rounds} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    return got


def report(got: dict[str, list[float]], lines: list[str]) -> dict[str, float]:
    """The table of part 3, and the numbers the targets need."""
    ms = lambda key, q: pct(got[key], q) * 1e3  # noqa: E731
    lone, ref_lone = ms("ours_lone", 50), ms("ref_lone", 50)
    lines.append(f"  {'':42s} {'median':>9s} {'p99':>9s}")
    lines.append(f"  {'lone frame, phyai-ray engine':42s} {lone:7.1f}ms {ms('ours_lone', 99):7.1f}ms")
    lines.append(f"  {'lone frame, LeRobot call (pre+predict+post)':42s} {ref_lone:7.1f}ms {ms('ref_lone', 99):7.1f}ms"
                 f"   (predict_action_chunk alone {ms('ref_lone_predict', 50):.1f}ms)")
    out = {"lone_ms": lone, "ref_lone_ms": ref_lone}
    for n in (8, 16):
        ours, seq, batch = (n / pct(got[k], 50) for k in (f"ours_wall_{n}", f"ref_seq_{n}", f"ref_batch_{n}"))
        each50, each99 = ms(f"ours_each_{n}", 50), ms(f"ours_each_{n}", 99)
        lines.append(f"  N={n:2d} {'phyai-ray, one expert step per iteration':37s} {ms(f'ours_wall_{n}', 50):7.1f}ms "
                     f"{ms(f'ours_wall_{n}', 99):7.1f}ms  {ours:6.1f} chunks/s; each robot's latency p50 {each50:.1f}ms "
                     f"p99 {each99:.1f}ms = {each50 / lone:.2f}x / {each99 / lone:.2f}x a lone frame")
        lines.append(f"  N={n:2d} {'LeRobot, one robot at a time':37s} {ms(f'ref_seq_{n}', 50):7.1f}ms "
                     f"{ms(f'ref_seq_{n}', 99):7.1f}ms  {seq:6.1f} chunks/s")
        lines.append(f"  N={n:2d} {'LeRobot, all N as one batch':37s} {ms(f'ref_batch_{n}', 50):7.1f}ms "
                     f"{ms(f'ref_batch_{n}', 99):7.1f}ms  {batch:6.1f} chunks/s (predict_action_chunk "
                     f"{ms(f'ref_batch_predict_{n}', 50):.1f}ms)")
        lines.append(f"  N={n:2d} throughput phyai-ray / LeRobot one batch {ours / batch:.2f}x, / one at a time "
                     f"{ours / seq:.2f}x")
        out.update({f"ours_{n}": ours, f"seq_{n}": seq, f"batch_{n}": batch, f"each99_{n}": each99,
                    f"each50_{n}": each50})
        results.record("throughput", robots=n, phyai_chunks_s=ours, lerobot_one_batch_chunks_s=batch,
                       lerobot_sequential_chunks_s=seq, latency_p50_ms=each50, latency_p99_ms=each99, lone_ms=lone)
    return out


def openpi_part(args: dict, robots: Robots, out: Path, threads: int, seconds: float, lines: list[str]) -> dict:
    """One Serve group of the policy; openpi-client robots in the clients' venv (see the module docstring)."""
    try:
        from tests.client_venv import client_python, run_script

        client_python()
    except Exception as exc:  # offline, or no pip index: say so and go on
        lines.append(f"  skipped: the openpi-client venv cannot be built here ({type(exc).__name__}: "
                     f"{str(exc).splitlines()[0][:200]})")
        return {}
    import ray
    from ray import serve

    from phyai_ray.config.deployment import WorkerSupervisorConfig
    from phyai_ray.serve import create_app
    from phyai_ray.serve.runtime.server import direct_ports
    from tests.helpers import free_port

    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}  # the rank's torch threads as inline
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        deployment = DeploymentConfig.local(replica_count=1, cpus_per_rank=0.5, process_config=WorkerSupervisorConfig(
            startup_timeout_s=180, execution_timeout_s=60))
        serve.run(create_app(EngineArgs(plugin=PLUGIN, plugin_args=args, config=CPU), deployment), name="policy",
                  route_prefix="/")
        ports = direct_ports(app_name="policy", timeout_s=20)
        url = f"ws://127.0.0.1:{ports[0]}/v1/openpi" if ports else f"ws://127.0.0.1:{port}/v1/openpi"
        robots.openpi_npz(out / "frames.npz", 8)
        text = run_script(ROBOTS, url, str(out / "frames.npz"), "8", "20", str(seconds), "100", "40",
                          timeout_s=seconds + 300)
        got = json.loads(text.splitlines()[-1])
    finally:
        serve.shutdown()
        ray.shutdown()
    lone = np.array(got["lone"])
    overhead = lone[:, 0] - lone[:, 1]
    via = "the group's direct ingress" if ports else "Serve's proxy (no direct ingress port found)"
    lines.append(f"  one robot via {via}, frames back to back: round trip p50 {pct(lone[:, 0], 50):.1f}ms p99 "
                 f"{pct(lone[:, 0], 99):.1f}ms, server infer_ms p50 {pct(lone[:, 1], 50):.1f}ms; non-model overhead "
                 f"p50 {pct(overhead, 50):.2f}ms p99 {pct(overhead, 99):.2f}ms")
    recs = list(got["robots"].values())
    sent, on_time = sum(r["sent"] for r in recs), sum(r["on_time"] for r in recs)
    rtt, sizes = [x for r in recs for x in r["rtt"]], [x for r in recs for x in r["sizes"]]
    errors = [e for r in recs for e in r["errors"]]
    got = {"overhead_p50": pct(overhead, 50), "overhead_p99": pct(overhead, 99), "frames": sent, "rate": sent / seconds,
           "on_time": on_time / max(sent, 1), "rtt_p50": pct(rtt, 50), "rtt_p99": pct(rtt, 99),
           "mean_batch": statistics.fmean(sizes) if sizes else 0.0}
    lines.append(f"  8 robots at 20 Hz, 100 ms deadlines, {seconds:.0f}s: {sent} frames ({got['rate']:.0f}/s of 160/s "
                 f"due), on time {got['on_time']:.1%}, rtt p50 {got['rtt_p50']:.1f}ms p99 {got['rtt_p99']:.1f}ms, mean "
                 f"batch {got['mean_batch']:.1f}, error frames {len(errors)}{' (e.g. ' + errors[0][:120] + ')' if errors else ''}")
    results.record("openpi", **got)
    return got


def targets(num: dict, fleet: dict) -> list[str]:
    lines = ["Targets (issue 31)",
             f"  N=8 throughput >= 0.9x LeRobot's one 8-robot call: {num['ours_8'] / num['batch_8']:.2f}x "
             f"-> {MARK[num['ours_8'] >= 0.9 * num['batch_8']]}",
             f"  N=8 each robot's frame latency <= 1.5x a lone frame's: p99 {num['each99_8'] / num['lone_ms']:.2f}x "
             f"(p50 {num['each50_8'] / num['lone_ms']:.2f}x) -> {MARK[num['each99_8'] <= 1.5 * num['lone_ms']]}"]
    if fleet:
        lines.append(f"  non-model overhead per frame over direct ingress <= 3 ms p50: {fleet['overhead_p50']:.2f}ms "
                     f"-> {MARK[fleet['overhead_p50'] <= 3.0]}")
        lines.append(f"  8 openpi-client robots at 20 Hz all on time, sharing batches: {fleet['on_time']:.1%} on time, "
                     f"{fleet['rate']:.0f} frames/s, mean batch {fleet['mean_batch']:.1f} -> "
                     f"{MARK[fleet['on_time'] >= 1.0 and fleet['mean_batch'] > 1.0]}")
    else:
        lines.append("  the openpi-client targets: not measured (see part 4)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two sides in part 3")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long the 20 Hz robots run in part 4")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides (1: on a shared small "
                        "machine OpenMP threads spin at every op while another process holds a core)")
    parser.add_argument("--no-openpi", action="store_true", help="skip part 4 (it starts Ray and Serve)")
    results.add_flag(parser)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-policy-") as tmp:
        out = Path(tmp)
        ref = ReferenceProcess(out, opts.threads)
        try:
            meta, robots = ref.meta, Robots(out, ref.meta)
            args = {"model": str(out / "pretrained_model"), "tokenizer": str(out / "backbone"), "sizes": meta["sizes"]}
            lines = [f"policy: pi0-shaped, {meta['parameters']:,} parameters (LeRobot {meta['lerobot']}, torch "
                     f"{meta['torch']} there), chunk 50 x 32, 10 steps, 2 cameras at 96x96 (36 patches each), "
                     f"48-token prompt; {opts.threads} torch threads on both sides"]
            with Engine(EngineArgs(plugin=PLUGIN, plugin_args=args, config=CPU)) as engine:
                want = torch.tensor(ref.ask(cmd="actions", robot=0)["actions"])
                have = engine.submit(robots.frame(0)).result(timeout=WAIT_S)["actions"]
                lines.append(f"1. parity: robot 0's chunk, max |phyai-ray - LeRobot| = {(have - want).abs().max():.1e}")
                parts = split(args, robots)
                lines.append(f"2. split (the plugin's model called directly): prefix pass (preprocess + VLM) 1 frame "
                             f"{parts['prefix_1_ms']:.1f}ms, 8 frames in one pass {parts['prefix_8_ms']:.1f}ms; one "
                             f"expert step: 1 frame {parts['step_1_ms']:.2f}ms, 8 frames {parts['step_8_ms']:.2f}ms, "
                             f"16 frames {parts['step_16_ms']:.2f}ms")
                results.record("split", **parts)
                with Engine(EngineArgs(plugin=PLUGIN, plugin_args={**args, "batch_prefixes": False}, config=CPU)) as old:
                    engine_batch(old, robots, range(8))  # warm
                    lines.append(f"2b. 8 robots arriving together, prefix passes per frame vs batched, {opts.rounds * 2} "
                                 "alternating rounds")
                    prefixes_part(engine, old, robots, opts.rounds, lines)
                lines.append(f"3. N robots whose frames arrive together, {opts.rounds} alternating rounds")
                num = report(side_by_side(engine, robots, ref, opts.rounds), lines)
        finally:
            ref.close()
        lines.append("4. openpi-client robots on a Serve app")
        try:
            fleet = {} if opts.no_openpi else openpi_part(args, robots, out, opts.threads, opts.seconds, lines)
        except Exception as exc:  # parts 1-3 still print
            fleet = {}
            lines.append(f"  failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        if opts.no_openpi:
            lines.append("  skipped (--no-openpi)")
    from bench_joins import joins_part  # beside this script; it imports this one's helpers

    lines.append(joins_part(opts.rounds))
    print("\n".join(lines + targets(num, fleet)), flush=True)
    results.write(opts.json, "policy", machine())


if __name__ == "__main__":
    main()
