"""Robot fleets on a pi0-shaped `lerobot_policy`: finish-by vs start-by, late="drop", EDF vs FIFO, overhead, failover.

Run: `flock /tmp/phyai-ray-tests.lock env PYTHONPATH=. .venv/bin/python benchmarks/fleet_policy.py [--seconds 4]
[--robots 8] [--frames 100] [--failover-robots 4] [--only fleet|serve]`
(bench_fleet.py --policy lerobot runs it; parts 1 and 2 need no Ray, no LeRobot; 3 and 4 start Ray and Serve.)

The policy: bench_joins.py's pi0-shaped folder (random weights, 10 steps). Robots are threads at
20 Hz, each frame with its own deadline: 2, 3, 4 or 5 times a lone frame's latency on this machine
(measured first), in turn, as bench_fleet.py's robots have 60-180 ms;
`max_num_seqs` bounds the frames denoised together, so a fleet larger than the group holds on time
queues. Per configuration: frames due, answered within their deadline (goodput), answered
DeadlineMissedError (refused at admission, or a late chunk dropped with late="drop"), and stale
chunks delivered (ready after their deadline: late="finish" hands them to the robot).

    (1) admission: finish-by (a frame starts only if its steps x the recent iteration time end in
        time) vs start-by (the same engine with the estimate forced to 0), each with late="finish"
        and late="drop"
    (2) scheduling: "deadline" (EDF) vs "fifo", the robots beside 4 bulk clients without deadlines
    (3) non-model overhead per frame over openpi (round trip minus the server's infer_ms), one robot
        sending frames back to back through Serve's proxy and the group's direct ingress, measured
        first for reference_flow_policy (bench_fleet.py's part c) and then for the policy, in one Ray
    (4) failover with real-time chunking: a Serve app of 2 groups of the policy (0.5 CPU a rank),
        openpi-client robots of examples/robot_fleet.py (policy_failover_robots.py, the clients' venv)
        at 12.5 Hz sending at half a chunk (5 of its 10 actions) with RTC; once every robot has chunks,
        the rank of the group holding most robots is killed (SIGKILL; a one-rank group runs inline in
        its Serve replica): each robot's time from the kill to its next chunk, and the seam of the
        first chunk after its failover against the fleet's ordinary seams (tests/test_robot_failover.py's
        measure). LeRobot's RTC guides the prev_actions span without freezing it (RTCRule.lerobot), so
        seams inside inference_delay are small, not 0 as on reference_flow_policy
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fleet  # noqa: E402  (part c and its robot session, reused for (3))
from bench_fleet import pct  # noqa: E402
from bench_joins import frame, pi0_shaped  # noqa: E402
from bench_policy import machine  # noqa: E402
from phyai_ray import BatchingConfig, DeploymentConfig, Engine, EngineArgs  # noqa: E402
from phyai_ray.errors import DeadlineMissedError  # noqa: E402

HZ = 20.0
# the pi0-shaped chunk of 10 actions lasts 0.8 s; a frame leaves with 0.4 s of queue, as the robots of
# tests/test_robot_failover.py (horizon 16 at 20 Hz). At 20 Hz (0.25 s) a failover outlasted the queue here.
FAILOVER_HZ = 12.5
ROBOTS = Path(__file__).resolve().parent / "policy_failover_robots.py"


@contextlib.contextmanager
def start_by() -> Iterator[None]:
    """Finish-by admission off: every replica's step-time estimate reads 0 (a frame starts if its
    deadline has not passed), as before finish-by."""
    from phyai_ray.executors.service import ServiceTime

    measured = ServiceTime.estimate
    ServiceTime.estimate = lambda self: 0.0
    try:
        yield
    finally:
        ServiceTime.estimate = measured


class Tally:
    def __init__(self) -> None:
        self.due = self.on_time = self.missed = self.stale = 0
        self.lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self.lock:
            for key, n in counts.items():
                setattr(self, key, getattr(self, key) + n)


def robot(engine: Engine, r: int, until: float, late: str | None, tally: Tally, deadline_ms: float | None) -> None:
    payload, tick = frame(r), 1.0 / HZ
    while (start := time.monotonic()) < until:
        future = engine.submit(payload, deadline_s=None if deadline_ms is None else deadline_ms / 1e3, late=late)
        try:
            future.result(timeout=30)
            met = future.timing().get("deadline_met")
            tally.add(due=1, on_time=int(met is not False), stale=int(met is False))
        except DeadlineMissedError:
            tally.add(due=1, missed=1)
        if deadline_ms is not None:
            time.sleep(max(0.0, start + tick - time.monotonic()))


def lone_ms(args: dict) -> float:
    """A lone frame's latency on this machine now (the deadlines are multiples of it)."""
    with Engine(EngineArgs(plugin="lerobot_policy", plugin_args=args)) as engine:
        engine.step(frame(0))
        times = []
        for _ in range(3):
            began = time.perf_counter()
            engine.step(frame(0))
            times.append(time.perf_counter() - began)
    return sorted(times)[1] * 1e3


def run(args: dict, robots: int, seconds: float, late: str, lone: float, scheduling: str = "deadline",
        bulk: int = 0) -> Tally:
    batching = BatchingConfig(max_num_seqs=4, scheduling=scheduling)
    tally, bulk_tally = Tally(), Tally()
    with Engine(EngineArgs(plugin="lerobot_policy", plugin_args=args), DeploymentConfig(batching=batching)) as engine:
        engine.step(frame(0))  # warm: the step time is known
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=robot, args=(engine, r, until, late, tally, lone * (2 + r % 4)))
                   for r in range(robots)]
        threads += [threading.Thread(target=robot, args=(engine, 100 + b, until, None, bulk_tally, None))
                    for b in range(bulk)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return tally


def line(label: str, t: Tally, seconds: float) -> str:
    return (f"  {label}: {t.due} due, goodput {t.on_time / seconds:.1f} frames/s ({t.on_time / max(t.due, 1):.0%} on "
            f"time), {t.missed} answered DeadlineMissedError, {t.stale} stale chunks delivered")


def fleet_part(seconds: float = 4.0, robots: int = 8) -> str:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fleet-policy-") as tmp:
        args = pi0_shaped(Path(tmp), steps=10)
        lone = lone_ms(args)
        lines = [f"lerobot_policy fleets: pi0-shaped (bench_joins.py's, 10 steps; a lone frame {lone:.0f} ms), inline "
                 f"engine, max_num_seqs 4, {robots} robots at {HZ:.0f} Hz with deadlines of 2, 3, 4, 5 lone frames in "
                 f"turn, {seconds:.0f} s a run"]
        for late in ("finish", "drop"):
            for rule in ("finish-by", "start-by"):
                with start_by() if rule == "start-by" else contextlib.nullcontext():
                    lines.append(line(f"(1) {rule}, late={late}", run(args, robots, seconds, late, lone), seconds))
        for scheduling in ("deadline", "fifo"):
            lines.append(line(f"(2) scheduling={scheduling}, beside 4 bulk clients",
                              run(args, robots, seconds, "finish", lone, scheduling, bulk=4), seconds))
    return "\n".join(lines)


# -- (3) and (4): the policy behind Serve, robots over openpi ------------------------------------------

class PolicySession(bench_fleet.Session):
    """bench_fleet.py's robot session sending the pi0-shaped policy's observation under openpi's keys:
    {"observation/state": 6 floats, "observation/image": uint8 96 x 96 x 3, "observation/wrist_image": ...,
    "prompt": "pick up cube 0", "step": 3}."""

    def observation(self, rng: np.random.Generator, step: int, state_dim: int) -> dict:
        return {"observation/state": rng.standard_normal(6).astype(np.float32),
                "observation/image": rng.integers(0, 256, (96, 96, 3), dtype=np.uint8),
                "observation/wrist_image": rng.integers(0, 256, (96, 96, 3), dtype=np.uint8),
                "prompt": f"pick up cube {self.index}", "step": step}


@contextlib.contextmanager
def serve_on(port: int) -> Iterator[None]:
    """Ray (8 logical CPUs, one torch thread a rank) and Serve's proxy on `port`, direct ingress on."""
    import ray
    from ray import serve

    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(args: dict, groups: int) -> None:
    """The app "policy" at "/": `groups` one-rank groups of the policy on CPU, 0.5 CPU a rank. Health checks
    every 60 s: Serve's own check does not race the robots' failover (as in tests/test_robot_failover.py)."""
    from ray import serve

    from phyai_ray import DeviceConfig, EngineConfig
    from phyai_ray.config.deployment import WorkerSupervisorConfig
    from phyai_ray.serve import create_app

    engine = EngineArgs(plugin="lerobot_policy", plugin_args=args, config=EngineConfig(device=DeviceConfig(target="cpu")))
    deployment = DeploymentConfig.local(replica_count=groups, cpus_per_rank=0.5, process_config=WorkerSupervisorConfig(
        startup_timeout_s=180, execution_timeout_s=60))
    serve.run(create_app(engine, deployment, health_check_period_s=60), name="policy", route_prefix="/")


def overhead_part(args: dict, port: int, frames: int) -> list[str]:
    """(3): bench_fleet.py's part c for reference_flow_policy, then the same robot on the policy."""
    from ray import serve

    from phyai_ray.serve.runtime.server import direct_ports

    lines = ["  reference_flow_policy (bench_fleet.py's part c):"] + bench_fleet.part_c(port, frames)
    serve.delete("fleet")
    deploy(args, 1)
    try:
        url = f"ws://127.0.0.1:{port}/v1/openpi"
        asyncio.run(bench_fleet.drive_count(PolicySession(0, None, 5000.0), url, 3))  # warm
        proxy, direct = PolicySession(0, None, 5000.0), PolicySession(0, None, 5000.0)
        asyncio.run(bench_fleet.drive_count(proxy, url, frames))
        ports = direct_ports("policy", timeout_s=10)
        if ports:
            asyncio.run(bench_fleet.drive_count(direct, f"ws://127.0.0.1:{ports[0]}/v1/openpi", frames))
    finally:
        serve.delete("policy")
    lines.append("  lerobot_policy, pi0-shaped, frames back to back:")
    for label, s in (("through Serve's proxy", proxy), ("direct ingress (the group's own port)", direct)):
        if not s.rtt:
            lines.append(f"    {label}: not measured (no direct ingress port)")
            continue
        infer = [r - o for r, o in zip(s.rtt, s.overhead)]
        lines.append(f"    {label}: round trip p50 {pct(s.rtt, 50):6.2f} ms, server infer_ms p50 {pct(infer, 50):6.2f} ms, "
                     f"non-model overhead p50 {pct(s.overhead, 50):5.2f} ms p99 {pct(s.overhead, 99):6.2f} ms "
                     f"({len(s.rtt)} frames)")
    return lines


def groups(base: str) -> list[dict]:
    import requests

    return requests.get(f"http://{base}/v1/replicas", timeout=30).json()["replicas"]


def kill_busiest(base: str, robots: int) -> tuple[dict, float]:
    """Once every robot has a session and ordinary chunks came (2 s more), SIGKILL the rank of the group
    holding most robots (its Serve replica: the rank runs inline); (that group's report, when)."""
    from tests.helpers import wait_until

    spread = wait_until(lambda: (lambda gs: sum(g["sessions"] for g in gs) >= robots and gs)(groups(base)), 120,
                        f"{robots} robot sessions on {base}")
    time.sleep(2.0)
    victim = max(spread, key=lambda g: g["sessions"])
    killed = time.time()
    os.kill(victim["pids"][0], signal.SIGKILL)
    return victim, killed


def failover_part(args: dict, port: int, robots: int, seconds: float) -> list[str]:
    """(4): see the module docstring."""
    from ray import serve

    from tests.client_venv import client_python
    from tests.helpers import wait_until

    python, base = client_python(), f"127.0.0.1:{port}"
    deploy(args, 2)
    try:
        wait_until(lambda: len(groups(base)) == 2 and all(g["state"] == "serving" for g in groups(base)), 120,
                   "2 groups serving")
        argv = [python, str(ROBOTS), f"ws://{base}/v1/openpi"]
        procs = [subprocess.Popen([*argv, str(r), str(FAILOVER_HZ), str(seconds)], stdout=subprocess.PIPE, text=True)
                 for r in range(robots)]
        try:
            victim, killed = kill_busiest(base, robots)
            reports = [json.loads(p.communicate(timeout=seconds + 120)[0].strip().splitlines()[-1]) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    finally:
        serve.delete("policy")
    return failover_lines(reports, victim, killed, robots, seconds)


def failover_lines(reports: list[dict], victim: dict, killed: float, robots: int, seconds: float) -> list[str]:
    """(4)'s report from the robots' (robot_fleet.py's `Robot` reports)."""
    gave_up = [f"robot {r['robot']}: {r['gave_up']}" for r in reports if r.get("gave_up")]
    if any(r.get("sent") is None for r in reports):
        return ["  robots that found no group: " + "; ".join(gave_up)]
    moved = [r for r in reports if any(g == victim["group"] for t, g, _ in r["chunks"] if t < killed)]
    stayed = [r for r in reports if r not in moved]

    def resumed(r: dict) -> float:
        return round(next((t for t, *_ in r["chunks"] if t > killed), float("nan")) - killed, 3)

    profiles = [p for r in reports for p in r["past_prefix"]]
    as_late = [round(max((p[i] for p in profiles if len(p) > i), default=float("nan")), 4) for i in range(3)]
    ordinary = [s for r in reports for s in r["seams"] if s is not None]
    failovers = [f for r in moved for f in r["failovers"]]
    seams = [None if f["seam"] is None else round(f["seam"], 4) for f in failovers]
    errors = [e for r in reports for e in r["errors"]]
    return [f"  {robots} robots at {FAILOVER_HZ:g} Hz (chunk 10, a frame at half a chunk, RTC, late 'finish'), "
            f"{seconds:.0f} s; SIGKILL to group {victim['group']} (pid {victim['pids'][0]}) holding "
            f"{victim['sessions']} session(s): {len(moved)} robot(s) moved, {len(stayed)} stayed",
            f"  kill -> next chunk: moved {[resumed(r) for r in moved]} s, stayed {[resumed(r) for r in stayed]} s; "
            f"reconnect attempts {[f['attempts'] for f in failovers]}",
            f"  first chunk after failover: seam {seams}, actions past inference_delay {[f['late_by'] for f in failovers]}",
            f"  ordinary chunks ({len(ordinary)}): seam p50 {pct(ordinary, 50):.4f} p90 {pct(ordinary, 90):.4f} max "
            f"{max(ordinary, default=float('nan')):.4f}; largest as late as 0, 1, 2 actions past inference_delay: {as_late}",
            f"  prefix equal to prev_actions: {all(r['prefix_exact'] for r in reports)} (LeRobot's RTC guides it, "
            f"freezes none); longest gap between chunks: moved {[round(r['max_gap_s'], 3) for r in moved]} s, stayed "
            f"{[round(r['max_gap_s'], 3) for r in stayed]} s; idle ticks {sum(r['idle_ticks'] for r in reports)} of "
            f"{sum(r['ticks'] for r in reports)}; errors {len(errors)}{' (e.g. ' + errors[0][:160] + ')' if errors else ''}"
            + (f"; gave up: {gave_up}" if gave_up else "")]


def serve_part(frames: int = 100, robots: int = 4, seconds: float = 8.0, port: int = 8791) -> str:
    """Parts (3) and (4) in one Ray, on their own pi0-shaped folder."""
    with tempfile.TemporaryDirectory(prefix="fleet-policy-serve-") as tmp, serve_on(port):
        args = pi0_shaped(Path(tmp), steps=10)
        lines = [f"(3) non-model overhead per frame over openpi, one robot, {frames} frames"]
        lines += overhead_part(args, port, frames)
        lines += ["(4) failover with real-time chunking, 2 one-rank groups of the pi0-shaped policy, 0.5 CPU a rank"]
        lines += failover_part(args, port, robots, seconds)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--robots", type=int, default=8)
    parser.add_argument("--frames", type=int, default=100, help="(3): frames per path")
    parser.add_argument("--failover-robots", type=int, default=4, help="(4): robots")
    parser.add_argument("--failover-seconds", type=float, default=8.0, help="(4): each robot's run")
    parser.add_argument("--port", type=int, default=8791, help="(3), (4): Serve's proxy")
    parser.add_argument("--only", choices=("fleet", "serve"), help="fleet: parts 1 and 2; serve: parts 3 and 4")
    opts = parser.parse_args()
    print(machine(), flush=True)
    if opts.only in (None, "fleet"):
        print(fleet_part(opts.seconds, opts.robots), flush=True)
    if opts.only in (None, "serve"):
        print(serve_part(opts.frames, opts.failover_robots, opts.failover_seconds, opts.port), flush=True)


if __name__ == "__main__":
    main()
