"""Part (e) of bench_fleet.py: do deadlines mean what robots need, on one group past its capacity?

    capacity     the largest fleet (robots at 20 Hz, deadlines 60-180 ms) one group holds on time
                 (>= 95% of the frames due), given (--capacity) or found here (8, 12, 16, ... robots)
    goodput      at 1.25x, 2x (and 3x) that fleet: frames answered within their deadline per second
                 with finish-by admission (today: a frame starts only if its denoising steps x the
                 recent iteration time end before its deadline) and with start-by admission (the old
                 rule: it starts whenever a slot frees before its deadline, however late it will end)
    stale        at 2x: chunks delivered after their deadline with late="drop" and with late="finish",
                 as the server judged them (server_timing.deadline_met false) and as the robot saw
                 them (round trip > deadline: the server's verdict plus the way back through the proxy)
    no deadline  clients without a deadline beside the largest fleet: how long each request waits,
                 against default_deadline_s (today), and in the old order (no default deadline:
                 arrival + execution_timeout_s, with start-by admission)

Start-by is the same build with finish-by switched off by a benchmark-only switch: the Ray worker
setup hook `start_by_switch` below wraps every replica's service estimate so that it reads 0.0 while
the driver's switch file exists; admission then checks only that the deadline is still ahead (exactly
the old rule). One Ray, one group: the two rules alternate run by run (`rounds` times each, the order
flipped every round), so a drift of the shared machine's load falls on both alike. Robots are asyncio
sessions in this process speaking openpi's msgpack frames, as in part (a); each sends its next frame
when the last reply is back, at most 20 per second, so a frame refused at once frees its robot for a
fresher one. They reach the group on its own port (direct ingress) unless `via="proxy"`: past capacity
every frame, refused or not, costs the proxy two WebSocket hops, and on a 2-core machine that cost,
not the admission rule, decides how many frames the group can answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

HZ = 20.0
HELD = 0.95  # a fleet is held on time when this share of its due frames is answered in time
GRACE_S = 5.0  # a reply may come this long after the run's end (then the session counts it unanswered)
STEPS = (8, 12, 16, 24, 32, 40, 48)  # fleet sizes tried when the capacity is found here
SWITCH_ENV = "PHYAI_BENCH_START_BY_FILE"  # names the switch file to the workers
RULES = ("finish-by", "start-by")


def start_by_switch() -> None:
    """Ray `worker_process_setup_hook`, benchmark only: while the file that PHYAI_BENCH_START_BY_FILE
    names exists, every ServiceTime of this process estimates 0.0 (start-by admission); else as measured."""
    path = os.environ.get(SWITCH_ENV)
    if not path:
        return
    from phyai_ray.executors.service import ServiceTime

    measured = ServiceTime.estimate

    def estimate(self: ServiceTime) -> float:
        return 0.0 if os.path.exists(path) else measured(self)

    ServiceTime.estimate = estimate


@contextlib.contextmanager
def admission(rule: str) -> Iterator[None]:
    """Runs inside use `rule` ("finish-by" or "start-by"): the switch file exists only for start-by."""
    path = Path(os.environ[SWITCH_ENV])
    if rule == "start-by":
        path.touch()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def robot_deadline_ms(index: int) -> float:
    """60, 100, 140, 180 ms in turn: a robot's queue of unexecuted actions sets it (as in part a)."""
    return 60.0 + 40.0 * (index % 4)


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()


def pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


class Robot:
    """One openpi session: frames one after another at most `hz` per second (None: as fast as replies
    come), each with `deadline_ms` (None: none) and `late` ("finish", "drop" or None: the server's)."""

    def __init__(self, index: int, hz: float | None, deadline_ms: float | None, late: str | None) -> None:
        self.index, self.hz, self.deadline_ms, self.late = index, hz, deadline_ms, late
        self.rtt: list[float] = []  # delivered chunks
        self.outlasted: list[float] = []  # no deadline: ms a request had waited when the fleet stopped unanswered
        self.sent = self.on_time = self.stale_server = self.stale_client = 0
        self.refused = self.estimated = self.dropped = self.errors = 0
        self.last_error = ""

    async def run(self, url: str, until: float) -> None:
        import numpy as np
        import websockets

        from phyai_ray.serve.protocols.openpi import pack, unpack

        rng = np.random.default_rng(self.index)
        async with websockets.connect(url, compression=None, max_size=None, open_timeout=30) as ws:
            await asyncio.wait_for(ws.recv(), 30)  # the policy's metadata
            step, next_at = 0, time.monotonic()
            while time.monotonic() < until:
                if self.hz is not None:
                    await asyncio.sleep(max(next_at - time.monotonic(), 0))
                    next_at = max(next_at + 1 / self.hz, time.monotonic())
                frame: dict[str, Any] = {"state": rng.standard_normal(8).astype(np.float32), "step": step}
                if self.deadline_ms is not None:
                    frame["deadline_ms"] = self.deadline_ms
                if self.late is not None:
                    frame["late"] = self.late
                began = time.perf_counter()
                await ws.send(pack(frame))
                try:
                    reply = await asyncio.wait_for(ws.recv(), max(until - time.monotonic(), 0) + GRACE_S)
                except asyncio.TimeoutError:
                    reply = None
                rtt = (time.perf_counter() - began) * 1e3
                if reply is None and self.deadline_ms is not None:
                    self.errors, self.last_error = self.errors + 1, f"no reply {rtt:.0f} ms after the frame was sent"
                    return
                if reply is None or (self.deadline_ms is None and time.monotonic() > until):
                    # not answered while the fleet ran (a robot's last frames are still counted below)
                    self.outlasted.append(rtt - (time.monotonic() - until) * 1e3)
                    return
                self.sent, step = self.sent + 1, step + 1
                if isinstance(reply, str):
                    self._failed(reply)
                    continue
                timing = unpack(reply, 1 << 24)["server_timing"]
                self.rtt.append(rtt)
                if self.deadline_ms is not None:
                    self.on_time += rtt <= self.deadline_ms
                    self.stale_client += rtt > self.deadline_ms
                    self.stale_server += timing.get("deadline_met") is False

    def _failed(self, reply: str) -> None:
        """Sort an error frame: refused before it ran (by the estimate or not), dropped late, or other."""
        if "late result was dropped" in reply:
            self.dropped += 1
        elif "deadline_missed" in reply and "not run" in reply:
            self.refused += 1
            self.estimated += "iteration(s) of about" in reply or "a step takes about" in reply
        else:
            self.errors, self.last_error = self.errors + 1, reply[:300]


@dataclass
class Sample:
    """One run: its robots (deadlines) and its clients without a deadline, for `seconds`."""

    robots: list[Robot]
    others: list[Robot]
    seconds: float


async def _drive(sessions: list[Robot], url: str, seconds: float) -> None:
    until = time.monotonic() + seconds
    await asyncio.gather(*(s.run(url, until) for s in sessions))


def fleet(url: str, n: int, seconds: float, late: str, probes: int = 0, label: str = "") -> Sample:
    """`n` robots for `seconds`, each frame with `late`, and `probes` clients without a deadline beside them."""
    sample = Sample([Robot(i, HZ, robot_deadline_ms(i), late) for i in range(n)],
                    [Robot(1000 + i, None, None, None) for i in range(probes)], seconds)
    asyncio.run(_drive(sample.robots + sample.others, url, seconds))
    s = summarize([sample])
    print(f"    {label:<10} {n:3d} robots late={late:<6} (+{probes} without deadline): goodput {s['goodput']:6.1f} "
          f"frames/s, on time {s['on_time']:.0%}, refused {s['refused']}, stale {s['stale_server']}", flush=True)
    return sample


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """The runs' numbers together: counts summed, rates over their total time, percentiles of all replies."""
    robots = [r for s in samples for r in s.robots]
    others = [r for s in samples for r in s.others]
    seconds = sum(s.seconds for s in samples)
    rtt = [x for r in robots for x in r.rtt]
    on_time = sum(r.on_time for r in robots)
    due = sum(len(s.robots) * HZ * s.seconds for s in samples)
    out = {"robots": len(samples[0].robots), "runs": len(samples), "seconds": seconds, "goodput": on_time / seconds,
           "on_time": on_time / due, "sent": sum(r.sent for r in robots), "delivered": len(rtt),
           "rtt_p50_ms": pct(rtt, 50), "rtt_p99_ms": pct(rtt, 99), "refused": sum(r.refused for r in robots),
           "refused_by_estimate": sum(r.estimated for r in robots), "dropped_late": sum(r.dropped for r in robots),
           "stale_server": sum(r.stale_server for r in robots), "stale_client": sum(r.stale_client for r in robots),
           "errors": sum(r.errors for r in robots + others)}
    errors = [r.last_error for r in robots + others if r.errors]
    if errors:
        out["first_error"] = errors[0]
    if others:
        waits = [x for r in others for x in r.rtt]
        out.update(probe_answered=len(waits), probe_wait_p50_ms=pct(waits, 50) if waits else None,
                   probe_wait_p99_ms=pct(waits, 99) if waits else None, probe_wait_max_ms=max(waits, default=None),
                   probe_unanswered=sum(len(r.outlasted) for r in others),
                   probe_unanswered_waited_ms=max((x for r in others for x in r.outlasted), default=0.0))
    return out


def paired_ratios(finish_by: list[Sample], start_by: list[Sample]) -> list[float]:
    """Round by round, finish-by's goodput / start-by's (the two ran one after the other)."""
    return [divide(summarize([a])["goodput"], summarize([b])["goodput"]) for a, b in zip(finish_by, start_by)]


def divide(a: float, b: float) -> float:
    """a / b; inf when only b is 0, nan when both are (no frame on time either way)."""
    return a / b if b else (float("inf") if a else float("nan"))


def row_line(label: str, r: dict[str, Any]) -> str:
    return (f"  {label:<17} {r['robots']:3d} robots  goodput {r['goodput']:6.1f} frames/s on time ({r['on_time']:6.1%} "
            f"of due)  delivered {r['delivered']:5d} (rtt p50 {r['rtt_p50_ms']:6.1f} ms, p99 {r['rtt_p99_ms']:7.1f} ms)  "
            f"refused at once {r['refused']:4d} ({r['refused_by_estimate']} by the estimate)  dropped late "
            f"{r['dropped_late']:3d}  stale delivered {r['stale_server']:3d} (robot-seen {r['stale_client']})"
            + (f"  ERRORS {r['errors']}: {r.get('first_error')}" if r["errors"] else ""))


# -- the group and Ray ------------------------------------------------------------------------------

def deploy(port: int, policy: dict, slots: int, default_deadline_s: float | None, via: str,
           previous: str | None = None) -> str:
    """One group of reference_flow_policy (inline rank, per-step batching, `slots` sequence slots), as in
    (a); the URL robots reach it at (`via` "direct": the group's own port, not `previous`'s; else the proxy)."""
    from ray import serve

    from phyai_ray import BatchingConfig, DeploymentConfig, DeviceConfig, EngineArgs, EngineConfig
    from phyai_ray.config.deployment import WorkerSupervisorConfig
    from phyai_ray.serve import create_app

    args = EngineArgs(plugin="reference_flow_policy", plugin_args={**policy, "per_step": True},
                      config=EngineConfig(device=DeviceConfig(target="cpu")))
    batching = BatchingConfig(scheduling="deadline", max_num_seqs=slots, default_deadline_s=default_deadline_s)
    deployment = DeploymentConfig.local(replica_count=1, cpus_per_rank=0.5, batching=batching,
                                        process_config=WorkerSupervisorConfig(execution_timeout_s=30))
    serve.run(create_app(args, deployment), name="fleet", route_prefix="/")
    url = group_url(port, via, previous)
    fleet(url, slots, 2.0, "finish", label="warm")  # the replica's iteration time is known before any measurement
    return url


def group_url(port: int, via: str, previous: str | None, timeout_s: float = 60.0) -> str:
    """Through Serve's proxy, or straight to the one group's direct-ingress port (a redeployed group's
    new port: waits until the registry lists only it, at most `timeout_s`)."""
    if via == "proxy":
        return f"ws://127.0.0.1:{port}/v1/openpi"
    from phyai_ray.serve.runtime.server import direct_ports

    deadline = time.monotonic() + timeout_s
    while True:
        ports = direct_ports("fleet", timeout_s=10)
        url = f"ws://127.0.0.1:{ports[0]}/v1/openpi" if ports else None
        if len(ports) == 1 and url != previous:
            return url
        if time.monotonic() > deadline:
            raise RuntimeError(f"direct ingress: the group's own port did not settle within {timeout_s:.0f} s (ports "
                               f"{ports}, the previous group's {previous}); run part e with --via proxy")
        time.sleep(0.5)


@contextlib.contextmanager
def ray_with_switch(root: Path, port: int, via: str) -> Iterator[None]:
    """A fresh Ray and Serve whose workers run start_by_switch first, and the switch file's name."""
    import ray
    from ray import serve

    os.environ[SWITCH_ENV] = os.path.join(tempfile.gettempdir(), f"phyai-bench-start-by-{os.getpid()}")
    Path(os.environ[SWITCH_ENV]).unlink(missing_ok=True)
    env = {"env_vars": {"PYTHONPATH": f"{root}:{root / 'benchmarks'}", SWITCH_ENV: os.environ[SWITCH_ENV]},
           "worker_process_setup_hook": "fleet_deadlines.start_by_switch"}
    if via == "direct":  # read where Ray starts; Serve then gives each group a port of its own
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    ray.init(num_cpus=8, include_dashboard=False, runtime_env=env)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield
    finally:
        Path(os.environ[SWITCH_ENV]).unlink(missing_ok=True)
        serve.shutdown()
        ray.shutdown()


def find_capacity(url: str, seconds: float, slots: int) -> tuple[int, list[str]]:
    """The largest fleet in STEPS held on time (>= HELD of its frames), trying upwards from `slots`."""
    held, tried = None, []
    for n in [s for s in STEPS if s >= slots] or [slots]:
        s = summarize([fleet(url, n, seconds, "finish", label="capacity")])
        tried.append(f"{n}: {s['on_time']:.0%}")
        if s["on_time"] < HELD:
            break
        held = n
    if held is None:  # not even `slots` robots: half of them
        held = max(slots // 2, 1)
        s = summarize([fleet(url, held, seconds, "finish", label="capacity")])
        tried.append(f"{held}: {s['on_time']:.0%}")
    return held, tried


# -- part (e) -------------------------------------------------------------------------------------------

def part_e(root: Path, port: int, policy: dict, slots: int, seconds: float, capacity: int | None,
           multiples: list[float], rounds: int, default_deadline_s: float, probes: int, via: str,
           record: Any) -> list[str]:
    """Everything of (e) (see the module docstring); `record(table, **row)` keeps rows for --json."""
    lines = [f"(e) finish-by vs start-by admission, robots at {HZ:.0f} Hz (deadlines 60-180 ms), {slots} sequence "
             f"slots, {'direct ingress' if via == 'direct' else 'through the proxy'}, {seconds:g} s per run, "
             f"{rounds} run(s) per rule and fleet; load before: {load()}"]
    samples: dict[Any, list[Sample]] = {}
    with ray_with_switch(root, port, via):
        url = deploy(port, policy, slots, default_deadline_s, via)
        if capacity is None:
            capacity, tried = find_capacity(url, seconds, slots)
            lines.append(f"  capacity: {capacity} robots held on time (>= {HELD:.0%}; by fleet: {', '.join(tried)})")
        else:
            lines.append(f"  capacity: {capacity} robots (given, or the largest fleet part a held on time)")
        fleets = {m: max(round(m * capacity), capacity + 1) for m in multiples}
        for r in range(rounds):
            for m in multiples:
                for rule in RULES if r % 2 == 0 else RULES[::-1]:
                    with admission(rule):
                        samples.setdefault((rule, m, "finish"), []).append(
                            fleet(url, fleets[m], seconds, "finish", label=f"{rule} {m:g}x"))
        stale_at = 2.0 if 2.0 in fleets else max(fleets)
        for rule in RULES:
            with admission(rule):
                samples[(rule, stale_at, "drop")] = [fleet(url, fleets[stale_at], seconds, "drop", label=f"{rule} drop")]
        top = max(fleets)
        samples[("probe", "finish-by")] = [fleet(url, fleets[top], seconds, "drop", probes, label="no deadline")]
        url = deploy(port, policy, slots, None, via, previous=url)  # the old order: no default deadline
        with admission("start-by"):
            samples[("probe", "start-by")] = [fleet(url, fleets[top], seconds, "drop", probes, label="old order")]
    after = load()
    record("deadline_run", capacity=capacity, via=via, slots=slots, seconds=seconds, rounds=rounds,
           default_deadline_s=default_deadline_s, load_before=lines[0].split("load before: ")[1], load_after=after)
    return lines + report(samples, multiples, stale_at, default_deadline_s, probes, record) + [f"  load after: {after}"]


def report(samples: dict, multiples: list[float], stale_at: float, default_deadline_s: float, probes: int,
           record: Any) -> list[str]:
    lines, found = [], {key: summarize(runs) for key, runs in samples.items()}
    rows = [(m, "finish") for m in multiples] + [(stale_at, "drop")]
    for m, late in rows:
        for rule in RULES:
            r = found[(rule, m, late)]
            record("deadline_goodput", admission=rule, multiple=m, late=late,
                   **{k: v for k, v in r.items() if not k.startswith("probe")})
            lines.append(row_line(f"{rule} {m:g}x {late}", r))
    ratio = {(m, late): divide(found[("finish-by", m, late)]["goodput"], found[("start-by", m, late)]["goodput"])
             for m, late in rows}
    lines.append("  goodput finish-by / start-by, all runs pooled: " +
                 ", ".join(f"{m:g}x late={late} {v:.2f}x" for (m, late), v in ratio.items()))
    paired = {m: paired_ratios(samples[("finish-by", m, "finish")], samples[("start-by", m, "finish")]) for m in multiples}
    for m, values in paired.items():
        median = statistics.median(values)
        record("deadline_ratio", multiple=m, pooled=ratio[(m, "finish")] if math.isfinite(ratio[(m, "finish")]) else None,
               paired_median=median if math.isfinite(median) else None, paired=" ".join(f"{v:.3f}" for v in values))
    at_2x = statistics.median(paired[2.0]) if 2.0 in paired else None
    lines.append("  the same, run next to each other (median of the rounds' ratios; each round's in brackets): " +
                 ", ".join(f"{m:g}x {statistics.median(v):.2f}x [{' '.join(f'{x:.2f}' for x in v)}]"
                           for m, v in paired.items()) +
                 ("" if at_2x is None else f" (target >= 1.3x at 2x: {'met' if at_2x >= 1.3 else 'NOT met'})"))
    drop, finish = found[("finish-by", stale_at, "drop")], found[("finish-by", stale_at, "finish")]
    lines.append(f"  stale chunks delivered at {stale_at:g}x, finish-by: late=drop {drop['stale_server']} past the "
                 f"deadline by the server's clock ({drop['stale_client']} as the robots saw them), late=finish "
                 f"{finish['stale_server']} ({finish['stale_client']}); start-by: late=drop "
                 f"{found[('start-by', stale_at, 'drop')]['stale_server']}, late=finish "
                 f"{found[('start-by', stale_at, 'finish')]['stale_server']} "
                 f"(target 0 with drop: {'met' if drop['stale_server'] == 0 else 'NOT met'})")
    for rule, d in (("finish-by", default_deadline_s), ("start-by", None)):
        r = found[("probe", rule)]
        record("no_deadline", admission=rule, default_deadline_s=d, robots=r["robots"], goodput=r["goodput"],
               **{k: v for k, v in r.items() if k.startswith("probe")})
        bound = f"today, default_deadline_s={d:g} s" if d is not None else "old order (no default deadline, start-by)"
        left = (f"; {r['probe_unanswered']} still waiting when the fleet stopped (the longest for "
                f"{r['probe_unanswered_waited_ms']:.0f} ms)" if r["probe_unanswered"] else "")
        verdict = ""
        if d is not None:
            met = r["probe_answered"] > 0 and max(r["probe_wait_max_ms"], r["probe_unanswered_waited_ms"]) <= d * 1e3
            verdict = f" (target <= {d * 1e3:.0f} ms: {'met' if met else 'NOT met'})"
        waits = (f", wait p50 {r['probe_wait_p50_ms']:.0f} ms p99 {r['probe_wait_p99_ms']:.0f} ms max "
                 f"{r['probe_wait_max_ms']:.0f} ms" if r["probe_answered"] else "")
        lines.append(f"  {probes} clients without a deadline beside {r['robots']} robots, {bound}: {r['probe_answered']} "
                     f"answered while it ran{waits}{left}{verdict}; the robots' goodput {r['goodput']:.1f} frames/s")
    return lines
