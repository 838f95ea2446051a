"""Open-loop load with request classes and SLOs: goodput, the tail per class, a trace a seed replays.

    PYTHONPATH=. .venv/bin/python benchmarks/loadgen.py --preset robots --robots 8 --hz 10 --jitter-ms 10
    PYTHONPATH=. .venv/bin/python benchmarks/loadgen.py --preset wan --load 0.7 --seconds 30 --seed 7
    PYTHONPATH=. .venv/bin/python benchmarks/loadgen.py --preset robots --url http://127.0.0.1:8000 --key KEY

Open loop: every request is sent at its arrival time whatever the answers before it did (a robot at its
control rate, a user posting a job), so an overloaded server shows as a growing tail and missed SLOs, not
as a slower sender. A trace is a list of arrivals (offset s, class, request) drawn from `--seed`; the same
seed and arguments replay the same requests at the same offsets (`fingerprint` says so: it prints first).

* arrivals: `poisson(rate, seconds, classes, seed)` (exponential gaps, each request's class drawn by the
  classes' shares), `periodic(clients, hz, seconds, jitter_s, cls, seed)` (each client at its own random
  phase, each send moved by up to +-jitter_s: robots at a control rate).
* classes: `RequestClass(name, share, make, slo_s)`: `make(rng, i)` builds request i; `slo_s` is the
  latency that counts as met (None: throughput only). `--deadlines` also sends each SLO as the request's
  own deadline (`Engine.submit(deadline_s=...)`), so the engine may refuse what it cannot meet.
* drivers: an inline `Engine` (a preset builds it), or a running server's `/v1/step` over HTTP (`--url`).
* report, per class: sent, answered, errors (by type), met, goodput (met per second of the trace),
  attainment (met / sent), latency p50 / p95 / p99 of the answered; `--json` keeps it and every request's
  (class, arrival, latency, met) for `benchmarks/plot.py` (goodput_<preset>.png: latency against
  arrival time per class, its SLO drawn, and each class's goodput).

Presets: `robots`: `reference_flow_policy` (8 state dims), N robots at f Hz with jitter, SLO one period.
`wan`: a tiny random Wan folder (tests/diffusers_folders.py), Poisson at `--load` x the capacity measured
first (standalone times of each class; `--rate` fixes the rate instead, which a replay needs, as the
measured capacity varies), 80% 4-step requests with an SLO of 3x their standalone time and 20% 40-step
requests (throughput only).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results  # noqa: E402
from benchmarks.results import machine, quantile  # noqa: E402


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float  # of a Poisson trace's requests
    make: Callable[[random.Random, int], Any]
    slo_s: float | None = None  # met when answered within this; None: throughput only


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the trace starts
    cls: str
    index: int
    request: Any


@dataclass
class Outcome:
    arrival: Arrival
    latency_s: float | None = None  # None: no answer (an error)
    error: str | None = None
    met: bool = False


def poisson(rate: float, seconds: float, classes: list[RequestClass], seed: int) -> list[Arrival]:
    """Arrivals at `rate` per second over `seconds`, exponential gaps; each one's class by the shares."""
    if rate <= 0 or seconds <= 0:
        raise ValueError(f"poisson: rate ({rate}) and seconds ({seconds}) must be > 0")
    rng, out, t = random.Random(seed), [], 0.0
    weights = [c.share for c in classes]
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        cls = rng.choices(classes, weights)[0]
        out.append(Arrival(t, cls.name, len(out), cls.make(rng, len(out))))


def periodic(clients: int, hz: float, seconds: float, jitter_s: float, cls: RequestClass,
             seed: int) -> list[Arrival]:
    """`clients` senders at `hz`, each at a random phase, each send moved by up to +-jitter_s."""
    if clients < 1 or hz <= 0 or jitter_s < 0:
        raise ValueError(f"periodic: clients ({clients}) >= 1, hz ({hz}) > 0 and jitter_s ({jitter_s}) >= 0")
    rng, period, times = random.Random(seed), 1.0 / hz, []
    for client in range(clients):
        phase = rng.uniform(0, period)
        for k in range(int(seconds * hz) + 1):
            at = phase + k * period + rng.uniform(-jitter_s, jitter_s)
            if 0 <= at < seconds:
                times.append((at, client))
    times.sort()
    return [Arrival(at, cls.name, i, cls.make(rng, client)) for i, (at, client) in enumerate(times)]


def fingerprint(trace: list[Arrival]) -> str:
    """What a replay must reproduce: every arrival's offset (to the ns), class and request."""
    digest = hashlib.sha256()
    for a in trace:
        digest.update(f"{a.at:.9f}|{a.cls}|{a.request!r}\n".encode())
    return digest.hexdigest()[:16]


def run(trace: list[Arrival], send: Callable[[Arrival], Future], classes: list[RequestClass],
        timeout_s: float = 600.0) -> list[Outcome]:
    """Send each arrival at its offset from one pacing thread (open loop); wait for every answer."""
    slo = {c.name: c.slo_s for c in classes}
    outcomes = [Outcome(a) for a in trace]
    done = threading.Semaphore(0)

    def settle(outcome: Outcome, sent: float, future: Future) -> None:
        latency = time.perf_counter() - sent
        error = future.exception()
        if error is None:
            limit = slo[outcome.arrival.cls]
            outcome.latency_s, outcome.met = latency, limit is None or latency <= limit
        else:
            outcome.error = type(error).__name__
        done.release()

    start = time.perf_counter()
    for outcome in outcomes:
        wait = start + outcome.arrival.at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        sent = time.perf_counter()
        try:
            future = send(outcome.arrival)
        except Exception as exc:  # refused at once (overloaded, a bad request): the request's outcome
            future = Future()
            future.set_exception(exc)
        future.add_done_callback(lambda f, o=outcome, s=sent: settle(o, s, f))
    ends = time.perf_counter() + timeout_s
    for _ in outcomes:
        if not done.acquire(timeout=max(ends - time.perf_counter(), 0.001)):
            raise TimeoutError(f"loadgen: answers still missing {timeout_s} s after the trace ended")
    return outcomes


def report(outcomes: list[Outcome], classes: list[RequestClass], seconds: float) -> dict[str, dict[str, Any]]:
    """Per class: sent, answered, errors by type, met, goodput (met / s), attainment, latency quantiles."""
    out = {}
    for cls in classes:
        mine = [o for o in outcomes if o.arrival.cls == cls.name]
        latencies = [o.latency_s for o in mine if o.latency_s is not None]
        errors: dict[str, int] = {}
        for o in mine:
            if o.error is not None:
                errors[o.error] = errors.get(o.error, 0) + 1
        met = sum(o.met for o in mine)
        out[cls.name] = {"sent": len(mine), "answered": len(latencies), "errors": errors, "met": met,
                         "goodput": met / seconds, "attainment": met / len(mine) if mine else None,
                         "slo_s": cls.slo_s,
                         **{f"p{int(q * 100)}_s": quantile(latencies, q) for q in (0.5, 0.95, 0.99)}}
    return out


def print_report(table: dict[str, dict[str, Any]]) -> None:
    print(f"  {'class':<10} {'sent':>6} {'answered':>8} {'met':>6} {'goodput/s':>9} {'attain':>7} {'p50 ms':>8} "
          f"{'p95 ms':>8} {'p99 ms':>8} {'SLO ms':>8}  errors")
    for name, r in table.items():
        ms = lambda v: f"{1e3 * v:8.1f}" if v is not None else f"{'-':>8}"  # noqa: E731
        attain = f"{100 * r['attainment']:6.1f}%" if r["attainment"] is not None else f"{'-':>7}"
        print(f"  {name:<10} {r['sent']:>6} {r['answered']:>8} {r['met']:>6} {r['goodput']:>9.2f} {attain} "
              f"{ms(r['p50_s'])} {ms(r['p95_s'])} {ms(r['p99_s'])} {ms(r['slo_s'])}  {r['errors'] or ''}")


# -- drivers -----------------------------------------------------------------------------------------
def engine_sender(engine: Any, classes: list[RequestClass], deadlines: bool) -> Callable[[Arrival], Future]:
    slo = {c.name: c.slo_s for c in classes}
    return lambda a: engine.submit(a.request, **({"deadline_s": slo[a.cls]} if deadlines and slo[a.cls] else {}))


def http_sender(url: str, key: str | None, workers: int = 64, client: Any = None) -> Callable[[Arrival], Future]:
    """POST each request to `url`/v1/step as JSON (phyai_ray.serve.protocols.codec's form) from a pool of
    `workers` threads (`client`: a session to use instead of a `requests.Session`, e.g. Starlette's
    TestClient of an app)."""
    from concurrent.futures import ThreadPoolExecutor

    from phyai_ray.serve.protocols import codec

    pool = ThreadPoolExecutor(workers, thread_name_prefix="loadgen-http")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if client is None:
        import requests

        client = requests.Session()
        client.mount(url, requests.adapters.HTTPAdapter(pool_maxsize=workers))

    def post(a: Arrival) -> Any:
        answer = client.post(f"{url.rstrip('/')}/v1/step", json=codec.encode(a.request, root="request"),
                             headers=headers, timeout=600)
        if answer.status_code != 200:
            raise RuntimeError(f"HTTP {answer.status_code}: {answer.text[:200]}")
        return answer.json()

    return lambda a: pool.submit(post, a)


# -- presets ------------------------------------------------------------------------------------------
def robots_preset(opts: argparse.Namespace) -> tuple[list[Arrival], list[RequestClass], Any]:
    state = lambda rng, i: {"state": [rng.uniform(-1, 1) for _ in range(8)], "step": i}  # noqa: E731
    cls = RequestClass("robot", 1.0, state, slo_s=1.0 / opts.hz)
    trace = periodic(opts.robots, opts.hz, opts.seconds, opts.jitter_ms / 1e3, cls, opts.seed)
    return trace, [cls], lambda: _engine("reference_flow_policy", {"seed": 0})


def wan_preset(opts: argparse.Namespace) -> tuple[list[Arrival], list[RequestClass], Any]:
    from tests.diffusers_folders import build_wan

    folder = build_wan(Path(tempfile.mkdtemp(prefix="loadgen-")) / "wan")
    base = {"prompt": "a robot arm stacks cubes", "height": 32, "width": 32, "num_frames": 9, "guidance_scale": 1.0}
    job = lambda steps: (lambda rng, i: {**base, "num_inference_steps": steps, "seed": i})  # noqa: E731
    make = lambda: _engine("diffusers_pipeline", {"model": str(folder)})  # noqa: E731
    with make() as engine:  # standalone times: the SLOs and the capacity the load is a fraction of
        alone = {}
        for steps in (4, 40):
            engine.step(job(steps)(None, 0))
            started = time.perf_counter()
            engine.step(job(steps)(None, 1))
            alone[steps] = time.perf_counter() - started
    classes = [RequestClass("short", 0.8, job(4), slo_s=3 * alone[4]), RequestClass("long", 0.2, job(40))]
    capacity = 1.0 / (0.8 * alone[4] + 0.2 * alone[40])
    rate = opts.rate or opts.load * capacity
    print(f"standalone: 4 steps {1e3 * alone[4]:.0f} ms, 40 steps {1e3 * alone[40]:.0f} ms; capacity "
          f"{capacity:.2f} requests/s; offered {rate:.2f}/s = {rate / capacity:.2f}x")
    return poisson(rate, opts.seconds, classes, opts.seed), classes, make


def _engine(plugin: str, plugin_args: dict[str, Any]) -> Any:
    from phyai_ray import DeploymentConfig, DeviceConfig, Engine, EngineArgs, EngineConfig

    args = EngineArgs(plugin=plugin, plugin_args=plugin_args, config=EngineConfig(device=DeviceConfig(target="cpu")))
    return Engine(args, DeploymentConfig(mode="inline"))


PRESETS = {"robots": robots_preset, "wan": wan_preset}


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="robots")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the trace")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed: the same seed replays it")
    parser.add_argument("--robots", type=int, default=8)
    parser.add_argument("--hz", type=float, default=10.0)
    parser.add_argument("--jitter-ms", type=float, default=10.0)
    parser.add_argument("--load", type=float, default=0.7, help="wan: offered load as a fraction of capacity")
    parser.add_argument("--rate", type=float, help="wan: offered requests/s (instead of --load; the measured "
                        "capacity varies, so give it to replay a trace exactly)")
    parser.add_argument("--deadlines", action="store_true", help="send each class's SLO as the request's deadline")
    parser.add_argument("--url", help="a running server (its /v1/step) instead of an inline engine")
    parser.add_argument("--key", help="the server's API key")
    results.add_flag(parser)
    opts = parser.parse_args(argv)
    print(f"machine: {machine()}")
    trace, classes, make_engine = PRESETS[opts.preset](opts)
    print(f"trace: {len(trace)} requests over {opts.seconds:g} s, seed {opts.seed}, fingerprint {fingerprint(trace)}")
    if opts.url:
        outcomes = run(trace, http_sender(opts.url, opts.key), classes)
    else:
        with make_engine() as engine:
            outcomes = run(trace, engine_sender(engine, classes, opts.deadlines), classes)
    table = report(outcomes, classes, opts.seconds)
    print_report(table)
    for name, row in table.items():
        results.record("classes", cls=name, **{k: v for k, v in row.items() if k != "errors"},
                       errors=sum(row["errors"].values()))
    for o in outcomes:
        results.record("requests", cls=o.arrival.cls, at_s=o.arrival.at, latency_s=o.latency_s, met=o.met,
                       slo_s=next(c.slo_s for c in classes if c.name == o.arrival.cls))
    results.write(opts.json, f"goodput_{opts.preset}", f"{machine()}; preset {opts.preset}, seed {opts.seed}")
    return table


if __name__ == "__main__":
    main()
