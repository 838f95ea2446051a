"""Robot fleets on one group of `reference_flow_policy`: deadlines, per-step batching, overhead per frame.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_fleet.py [--seconds 4] [--fleets 4,8,16,32] [--only a|b|c|d|e]`
(`--policy lerobot`: a pi0-shaped lerobot_policy's fleet numbers, overhead per frame, failover with RTC and join
stall instead, benchmarks/fleet_policy.py)

One Serve group (TP=1, its rank inline in the Serve replica) behind the openpi WebSocket; robots are
asyncio sessions in this process speaking openpi's msgpack frames (each sends its next frame when the
previous reply is back, at most at its rate). Sequence slots are bounded (`max_num_seqs`, as a GPU's
memory bounds them), so frames queue when the fleet outgrows the group and the order matters.

    (a) goodput (frames answered within their deadline per second) against fleet size, robots at 20 Hz
        with deadlines of 60-180 ms (a robot's queue state sets it), for scheduling "deadline", "fifo",
        and unbatched (whole frames, max_batch_size 1)
    (b) mixed overload: 8 robots at 20 Hz with 100 ms deadlines beside bulk clients sending flat out
        with 2 s deadlines: the robots' on-time fraction, "deadline" vs "fifo"
    (c) non-model overhead per frame, round trip minus the server's infer_ms, through the group vs a
        bare `websockets` server running the same policy in one process (openpi's own server's shape)
    (d) admission latency of a frame that arrives while 8 others are being denoised: per-step batching
        (it joins at the next step) vs whole-frame batching (it waits for the batch), engine-side
    (e) at 1.25x, 2x and 3x the fleet one group holds on time (found, or --capacity): goodput of
        finish-by admission vs the old start-by, stale chunks delivered with late="drop" and "finish", and
        the wait of requests without a deadline beside the fleet (benchmarks/fleet_deadlines.py: its own
        Ray, robots on the group's own port unless --via proxy)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fleet_deadlines  # noqa: E402  (benchmarks/fleet_deadlines.py: part e)
import results  # noqa: E402  (benchmarks/results.py, beside this script)
from phyai_ray import BatchingConfig, DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig  # noqa: E402
from phyai_ray.config.deployment import WorkerSupervisorConfig  # noqa: E402
from phyai_ray.serve.protocols.openpi import pack, unpack  # noqa: E402

POLICY = {"seed": 0, "dim": 128, "hidden": 512, "blocks": 3, "horizon": 16, "num_steps": 10}
BIG_POLICY = {"seed": 0, "dim": 512, "hidden": 2048, "blocks": 4, "horizon": 50, "action_dim": 14, "num_steps": 10}
SLOTS = 8  # sequence slots of the group
FOUND: dict[str, int] = {}  # what one part leaves for a later one: part a's largest fleet held on time
BARE_SERVER = '''
import asyncio, sys, time
import websockets
from phyai_ray.config.parallel import ParallelConfig
from phyai_ray.config.engine import DeviceConfig
from phyai_ray.executors.inline import build_inline_runner
from phyai_ray.plugins.registry import resolve_plugin
from phyai_ray.serve.protocols.openpi import pack, unpack
entry = resolve_plugin("reference_flow_policy")
args = eval(sys.argv[2])
entry.configure(args)
model = build_inline_runner(entry, args, ParallelConfig(), DeviceConfig(target="cpu")).model
async def serve(ws):
    await ws.send(pack(entry.policy_metadata()))
    async for frame in ws:
        began = time.perf_counter()
        obs = unpack(frame, 1 << 24)
        obs.pop("deadline_ms", None)
        out = model.step(obs)
        out["server_timing"] = {"infer_ms": (time.perf_counter() - began) * 1e3}
        await ws.send(pack(out))
async def main():
    async with websockets.serve(serve, "127.0.0.1", int(sys.argv[1]), compression=None, max_size=None):
        print("ready", flush=True)
        await asyncio.Future()
asyncio.run(main())
'''


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    import ray

    return (f"machine: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} intra-op threads), ray {ray.__version__}")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# -- the group -----------------------------------------------------------------------------------------

def deploy(port: int, scheduling: str, per_step: bool = True) -> str:
    from ray import serve

    from phyai_ray.serve import create_app

    args = EngineArgs(plugin="reference_flow_policy", plugin_args={**POLICY, "per_step": per_step},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    batching = BatchingConfig(scheduling=scheduling, max_num_seqs=SLOTS, max_batch_size=None if per_step else 1)
    deployment = DeploymentConfig.local(replica_count=1, cpus_per_rank=0.5, batching=batching,
                                        process_config=WorkerSupervisorConfig(execution_timeout_s=30))
    serve.run(create_app(args, deployment), name="fleet", route_prefix="/")
    return f"ws://127.0.0.1:{port}/v1/openpi"


class Session:
    """One robot or bulk client: frames sent one after another, at most `hz` per second (None: flat out)."""

    def __init__(self, index: int, hz: float | None, deadline_ms: float) -> None:
        self.index, self.hz, self.deadline_ms = index, hz, deadline_ms
        self.rtt: list[float] = []
        self.overhead: list[float] = []
        self.sizes: list[int] = []
        self.sent = self.on_time = self.missed = 0

    def observation(self, rng: np.random.Generator, step: int, state_dim: int) -> dict:
        """The frame's observation (reference_flow_policy's; fleet_policy.py sends a lerobot_policy's)."""
        return {"state": rng.standard_normal(state_dim).astype(np.float32), "step": step}

    async def run(self, url: str, until: float, state_dim: int = 8) -> None:
        import websockets

        rng = np.random.default_rng(self.index)
        async with websockets.connect(url, compression=None, max_size=None) as ws:
            await ws.recv()
            step, next_at = 0, time.monotonic()
            while time.monotonic() < until:
                if self.hz is not None:
                    await asyncio.sleep(max(next_at - time.monotonic(), 0))
                    next_at = max(next_at + 1 / self.hz, time.monotonic())
                frame = {**self.observation(rng, step, state_dim), "deadline_ms": self.deadline_ms}
                began = time.perf_counter()
                await ws.send(pack(frame))
                reply = await ws.recv()
                rtt = (time.perf_counter() - began) * 1e3
                self.sent, step = self.sent + 1, step + 1
                if isinstance(reply, str):
                    self.missed += "deadline_missed" in reply
                    continue
                timing = unpack(reply, 1 << 24)["server_timing"]
                self.rtt.append(rtt)
                self.overhead.append(rtt - timing["infer_ms"])
                self.sizes.append(timing.get("batch_size", 1))
                self.on_time += rtt <= self.deadline_ms


async def drive(sessions: list[Session], url: str, seconds: float) -> None:
    until = time.monotonic() + seconds
    await asyncio.gather(*(s.run(url, until) for s in sessions))


def part_a(port: int, fleets: list[int], seconds: float) -> list[str]:
    lines, goodput = [], {}
    for label, scheduling, per_step in (("deadline", "deadline", True), ("fifo", "fifo", True),
                                        ("unbatched", "deadline", False)):
        url = deploy(port, scheduling, per_step)
        for n in fleets:
            robots = [Session(i, 20.0, 60.0 + 40.0 * (i % 4)) for i in range(n)]
            asyncio.run(drive(robots, url, seconds))
            due = n * 20.0 * seconds
            on_time = sum(r.on_time for r in robots)
            rtt = [x for r in robots for x in r.rtt]
            sizes = [x for r in robots for x in r.sizes]
            goodput[(label, n)] = on_time / seconds
            results.record("goodput", policy=label, robots=n, goodput=on_time / seconds, on_time=on_time / due,
                           rtt_p50_ms=pct(rtt, 50), rtt_p99_ms=pct(rtt, 99))
            lines.append(f"  {label:<9} {n:3d} robots  goodput {on_time / seconds:7.1f} frames/s on time "
                         f"({on_time / due:6.1%} of {due / seconds:.0f}/s due)  rtt p50 {pct(rtt, 50):6.1f} ms "
                         f"p99 {pct(rtt, 99):7.1f} ms  mean batch {statistics.fmean(sizes) if sizes else 0:5.1f}  "
                         f"deadline_missed {sum(r.missed for r in robots)}")
    held = [n for n in fleets if goodput[("deadline", n)] >= 0.95 * n * 20.0]
    largest = max(held) if held else fleets[0]
    if held:
        FOUND["capacity"] = largest
    lines.append(f"  largest fleet on time with 'deadline': {largest} robots; goodput there "
                 f"{goodput[('deadline', largest)]:.1f} vs fifo {goodput[('fifo', largest)]:.1f} "
                 f"= {goodput[('deadline', largest)] / max(goodput[('fifo', largest)], 1e-9):.2f}x (target >= 1.3x); "
                 f"at {fleets[-1]} robots {goodput[('deadline', fleets[-1])] / max(goodput[('fifo', fleets[-1])], 1e-9):.2f}x")
    for n in fleets:
        lines.append(f"    {n:3d} robots: deadline / fifo {goodput[('deadline', n)] / max(goodput[('fifo', n)], 1e-9):5.2f}x, "
                     f"deadline / unbatched {goodput[('deadline', n)] / max(goodput[('unbatched', n)], 1e-9):5.2f}x")
    return lines


def part_b(port: int, seconds: float, bulk: int) -> list[str]:
    lines = []
    for scheduling in ("deadline", "fifo"):
        url = deploy(port, scheduling)
        robots = [Session(i, 20.0, 100.0) for i in range(8)]
        clients = [Session(100 + i, None, 2000.0) for i in range(bulk)]
        asyncio.run(drive(robots + clients, url, seconds))
        due = sum(r.sent for r in robots)
        on_time = sum(r.on_time for r in robots)
        rtt = [x for r in robots for x in r.rtt]
        lines.append(f"  {scheduling:<8} 8 robots (100 ms) beside {bulk} bulk clients (2 s): robots on time "
                     f"{on_time / max(due, 1):6.1%} of {due} frames (rtt p50 {pct(rtt, 50):6.1f} ms, p99 "
                     f"{pct(rtt, 99):7.1f} ms); bulk frames answered {sum(len(c.rtt) for c in clients)}")
    return lines


def part_c(port: int, frames: int) -> list[str]:
    from phyai_ray.serve.runtime.server import direct_ports

    url = deploy(port, "deadline")
    robot = Session(0, None, 5000.0)
    asyncio.run(drive([robot], url, 0.1))  # connect once (warm)
    group = Session(0, None, 5000.0)
    asyncio.run(drive_count(group, url, frames))
    direct = Session(0, None, 5000.0)
    ports = direct_ports("fleet", timeout_s=10)
    if ports:
        asyncio.run(drive_count(direct, f"ws://127.0.0.1:{ports[0]}/v1/openpi", frames))
    bare_port = port + 1
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", BARE_SERVER, str(bare_port), repr(POLICY)], stdout=subprocess.PIPE,
                            env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        bare = Session(0, None, 5000.0)
        asyncio.run(drive_count(bare, f"ws://127.0.0.1:{bare_port}", frames))
    finally:
        proc.kill()
    g, b, d = pct(group.overhead, 50), pct(bare.overhead, 50), pct(direct.overhead, 50)
    return [f"  through Serve's proxy: round trip p50 {pct(group.rtt, 50):6.2f} ms, non-model overhead p50 {g:5.2f} ms "
            f"p99 {pct(group.overhead, 99):6.2f} ms (target p50 <= 3 ms: {'met' if g <= 3 else 'NOT MET'})",
            f"  direct ingress (the group's own port): round trip p50 {pct(direct.rtt, 50):6.2f} ms, overhead p50 "
            f"{d:5.2f} ms p99 {pct(direct.overhead, 99):6.2f} ms (target p50 <= 3 ms: {'met' if d <= 3 else 'NOT MET'})",
            f"  bare websockets server, same policy: round trip p50 {pct(bare.rtt, 50):6.2f} ms, overhead p50 "
            f"{b:5.2f} ms p99 {pct(bare.overhead, 99):6.2f} ms;  overhead vs bare: proxy {g / max(b, 1e-9):.1f}x, "
            f"direct {d / max(b, 1e-9):.1f}x"]


async def drive_count(session: Session, url: str, frames: int) -> None:
    """`frames` frames one after another (no rate)."""
    until = time.monotonic() + 600
    task = asyncio.ensure_future(session.run(url, until))
    while session.sent < frames and not task.done():
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def part_d(rounds: int) -> list[str]:
    """A batch of 8 frames starts together (queued while the group was held); half way through it, one
    more frame arrives: how long until it starts (EngineFuture.timing()["queue_ms"])."""
    lines, step_ms = [], None
    for per_step in (True, False):
        batching = BatchingConfig(max_batch_size=None if per_step else 16)
        args = {**BIG_POLICY, "per_step": per_step}
        with Engine(EngineArgs(plugin="reference_flow_policy", plugin_args=args), DeploymentConfig(batching=batching)) as engine:
            frame = {"state": np.zeros(8, dtype=np.float32)}

            def batch_of_8(r: int) -> list:
                engine.pause(mode="keep")
                futures = [engine.submit({**frame, "noise_seed": r * 10 + i}) for i in range(8)]
                engine.resume()
                return futures
            for f in batch_of_8(0):  # warm, and the batch's length
                f.result(timeout=60)
            lengths, admission = [], []
            for r in range(rounds):
                running = batch_of_8(r + 1)
                while running[0].started is None:
                    time.sleep(0.0002)
                time.sleep(statistics.median(lengths) / 2e3 if lengths else 0.002)  # half way through the batch
                late = engine.submit({**frame, "noise_seed": 999})
                late.result(timeout=60)
                [f.result(timeout=60) for f in running]
                admission.append(late.timing()["queue_ms"])
                lengths.append((max(f.finished for f in running) - running[0].started) * 1e3)
            if per_step:
                step_ms = statistics.median(lengths) / BIG_POLICY["num_steps"]
            label = "per step" if per_step else "whole frames"
            lines.append(f"  {label:<12} admission of a frame arriving mid-batch p50 {pct(admission, 50):6.2f} ms "
                         f"p99 {pct(admission, 99):6.2f} ms  (the 8-frame batch takes {statistics.median(lengths):6.1f} ms)")
    lines.append(f"  one denoising step of the 8-frame batch: {step_ms:.2f} ms; per-step admission p50 / one step "
                 f"= {float(lines[0].split('p50')[1].split('ms')[0]) / step_ms:.2f} (target <= 1)")
    return lines



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--fleets", default="4,8,16,32")
    parser.add_argument("--bulk", type=int, default=32)
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--only", choices=("a", "b", "c", "d", "e"))
    parser.add_argument("--capacity", type=int, default=None,
                        help="(e): the fleet one group holds on time; default: found by trying (--via proxy: part a's)")
    parser.add_argument("--via", choices=("direct", "proxy"), default="direct",
                        help="(e): robots reach the group on its own port (direct ingress, the default: the proxy's "
                        "per-frame cost does not decide a scheduling result on a small machine) or through the proxy")
    parser.add_argument("--default-deadline-s", type=float, default=1.0,
                        help="(e): BatchingConfig.default_deadline_s of the group (short, so a run sees waits)")
    parser.add_argument("--probes", type=int, default=2, help="(e): clients without a deadline beside the fleet")
    parser.add_argument("--multiples", default="1.25,2,3", help="(e): fleets as multiples of the capacity")
    parser.add_argument("--rounds", type=int, default=3, help="(e): runs per admission rule and fleet, alternated")
    parser.add_argument("--policy", choices=("reference", "lerobot"), default="reference",
                        help="lerobot: a pi0-shaped lerobot_policy instead (fleet_policy.py, then bench_joins.py; starts Ray)")
    results.add_flag(parser)
    opts = parser.parse_args()
    if opts.policy == "lerobot":
        from bench_joins import joins_part
        from fleet_policy import fleet_part, serve_part

        print(machine(), flush=True)
        print(fleet_part(opts.seconds), flush=True)
        print(serve_part(opts.frames, port=opts.port), flush=True)
        print(joins_part(opts.rounds), flush=True)
        return
    import ray
    from ray import serve

    print(machine(), flush=True)
    report: list[str] = []
    if opts.only in (None, "d"):
        report += ["(d) admission mid-batch (inline engine)"] + part_d(20)
    if opts.only in (None, "a", "b", "c"):
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"  # (c) measures both paths; (a) and (b) use the proxy
        ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        serve.start(http_options={"host": "127.0.0.1", "port": opts.port})
        try:
            if opts.only in (None, "a"):
                report += [f"(a) goodput, robots at 20 Hz, deadlines 60-180 ms, {SLOTS} sequence slots, "
                           f"{opts.seconds:.0f} s each"] + part_a(opts.port, [int(n) for n in opts.fleets.split(",")],
                                                               opts.seconds)
            if opts.only in (None, "b"):
                report += ["(b) mixed overload"] + part_b(opts.port, opts.seconds, opts.bulk)
            if opts.only in (None, "c"):
                report += ["(c) non-model overhead per frame"] + part_c(opts.port, opts.frames)
        finally:
            serve.shutdown()
            ray.shutdown()
    if opts.only in (None, "e"):
        report += fleet_deadlines.part_e(ROOT, opts.port, POLICY, SLOTS, opts.seconds,
                                         opts.capacity or (FOUND.get("capacity") if opts.via == "proxy" else None),
                                         [float(m) for m in opts.multiples.split(",")], opts.rounds,
                                         opts.default_deadline_s, opts.probes, opts.via, results.record)
    print("\n".join(report))
    results.write(opts.json, "fleet_deadline" if opts.only == "e" else "fleet", machine())


if __name__ == "__main__":
    main()
