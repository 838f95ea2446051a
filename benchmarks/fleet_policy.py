"""Robot fleets on a pi0-shaped `lerobot_policy` (inline engine): finish-by vs start-by, late="drop", EDF vs FIFO.

Run: `env PYTHONPATH=. .venv/bin/python benchmarks/fleet_policy.py [--seconds 4] [--robots 8]`
(bench_fleet.py --policy lerobot runs it; no Ray, no LeRobot.)

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
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_joins import frame, pi0_shaped  # noqa: E402
from bench_policy import machine  # noqa: E402
from phyai_ray import BatchingConfig, DeploymentConfig, Engine, EngineArgs  # noqa: E402
from phyai_ray.errors import DeadlineMissedError  # noqa: E402

HZ = 20.0


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--robots", type=int, default=8)
    opts = parser.parse_args()
    print(machine(), flush=True)
    print(fleet_part(opts.seconds, opts.robots), flush=True)


if __name__ == "__main__":
    main()
