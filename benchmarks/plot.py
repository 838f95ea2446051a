"""Draw benchmark results (the JSON that `--json PATH` writes, benchmarks/results.py) as PNG plots.

    .venv/bin/python benchmarks/plot.py docs/benchmarks/data/*.json --out docs/benchmarks

One PNG per file, named after its benchmark (batching.png, generation.png, fleet.png, fleet_deadline.png,
load.png, world.png, loop.png, goodput_robots.png, goodput_wan.png, affinity.png), titled with the machine the file names. matplotlib only (the `docs` extra); no
display needed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections import defaultdict
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _by(rows: list[dict], key: str) -> dict[Any, list[dict]]:
    groups: dict[Any, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row[key]].append(row)
    return groups


def plot_batching(tables: dict, fig: Any) -> None:
    """Samples/s per deployment: batched and unbatched, fleet and closed loop, against one big request."""
    ax = fig.add_subplot(1, 1, 1)
    deployments = list(_by(tables["engine"], "deployment"))
    bars = [("fleet", "batching on"), ("fleet", "batching off"), ("closed loop", "batching on"),
            ("closed loop", "batching off")]
    width = 0.8 / (len(bars) + 1)
    for k, (shape, batching) in enumerate(bars):
        values = [next(r["samples_per_s"] for r in tables["engine"]
                       if r["deployment"] == d and r["shape"] == shape and r["batching"] == batching)
                  for d in deployments]
        ax.bar([i + k * width for i in range(len(deployments))], values, width, label=f"{shape}, {batching}")
    ones = [next(r["one_request"] for r in tables["engine"] if r["deployment"] == d) for d in deployments]
    ax.bar([i + len(bars) * width for i in range(len(deployments))], ones, width, label="the same samples as one request")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(deployments))], deployments)
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (log)")
    ax.legend(fontsize=7)


def plot_generation(tables: dict, fig: Any) -> None:
    """One-prompt requests / the same prompts as one request, against the number of requests."""
    ax = fig.add_subplot(1, 1, 1)
    for deployment, rows in _by(tables["engine"], "deployment").items():
        rows = sorted(rows, key=lambda r: r["n"])
        ax.plot([r["n"] for r in rows], [r["one_prompt_tok_s"] / r["one_request_tok_s"] for r in rows], "o-",
                label=deployment)
    ax.axhline(0.7, color="grey", linestyle="--", label="target 0.7")
    ax.set_xscale("log", base=2)
    sizes = sorted({r["n"] for r in tables["engine"]})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("one-prompt requests at once (N)")
    ax.set_ylabel("tokens/s ratio: N requests / one request")
    ax.set_ylim(0, 1.3)
    ax.legend(fontsize=8)


def plot_fleet(tables: dict, fig: Any) -> None:
    """Frames on time and goodput against fleet size, per scheduling policy."""
    on_time, goodput = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for policy, rows in _by(tables["goodput"], "policy").items():
        rows = sorted(rows, key=lambda r: r["robots"])
        robots = [r["robots"] for r in rows]
        on_time.plot(robots, [100 * r["on_time"] for r in rows], "o-", label=policy)
        goodput.plot(robots, [r["goodput"] for r in rows], "o-", label=policy)
    on_time.set_ylabel("frames on time (%)")
    goodput.set_ylabel("goodput (frames/s on time)")
    for ax in (on_time, goodput):
        ax.set_xscale("log", base=2)
        ax.set_xticks(robots, [str(n) for n in robots])
        ax.set_xlabel("robots at 20 Hz")
        ax.legend(fontsize=8)


def plot_fleet_deadline(tables: dict, fig: Any) -> None:
    """bench_fleet.py part e: goodput per admission rule at multiples of the fleet a group holds on time,
    and the chunks delivered after their deadline (the server's verdict and the robots')."""
    goodput, stale = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    rows = [r for r in tables["deadline_goodput"] if r["late"] == "finish"]
    multiples = sorted({r["multiple"] for r in rows})
    for k, (rule, rule_rows) in enumerate(_by(rows, "admission").items()):
        by_m = {r["multiple"]: r for r in rule_rows}
        goodput.bar([i + k * 0.4 for i in range(len(multiples))], [by_m[m]["goodput"] for m in multiples], 0.4,
                    label=rule)
    goodput.set_xticks([i + 0.2 for i in range(len(multiples))],
                       [f"{m:g}x ({next(r['robots'] for r in rows if r['multiple'] == m)} robots)" for m in multiples])
    goodput.set_ylabel("goodput (frames/s on time), late='finish'")
    goodput.legend(fontsize=8)
    at = [r for r in tables["deadline_goodput"] if r["multiple"] == 2.0] or tables["deadline_goodput"]
    at = [r for r in at if r["multiple"] == at[0]["multiple"]]
    labels = [f"{r['admission']}\nlate={r['late']}" for r in at]
    for shift, key, label in ((-0.2, "stale_server", "by the server's clock"), (0.2, "stale_client", "as the robots saw them")):
        stale.bar([i + shift for i in range(len(at))], [r[key] / r.get("runs", 1) for r in at], 0.4, label=label)
    stale.set_xticks(range(len(at)), labels, fontsize=7)
    stale.set_ylabel(f"chunks delivered after their deadline per run, {at[0]['multiple']:g}x")
    stale.legend(fontsize=8)


def plot_load(tables: dict, fig: Any) -> None:
    """p50 and p99 latency against offered load, phyai-ray beside bare Ray actors."""
    ax = fig.add_subplot(1, 1, 1)
    for side, rows in _by(tables["load"], "side").items():
        rows = sorted(rows, key=lambda r: r["load"])
        loads = [100 * r["load"] for r in rows]
        ax.plot(loads, [r["p50_ms"] for r in rows], "o-", label=f"{side} p50")
        ax.plot(loads, [r["p99_ms"] for r in rows], "s--", label=f"{side} p99")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (% of capacity)")
    ax.set_ylabel("latency (ms, log)")
    ax.legend(fontsize=8)


def plot_world(tables: dict, fig: Any) -> None:
    """Requests/s of N concurrent video requests (diffusers_pipeline vs diffusers' pipeline called once
    per request and once with all N prompts); one request's latency per parallel layout on Ray."""
    rates = fig.add_subplot(1, 2, 1)
    rows = sorted(tables["throughput"], key=lambda r: r["n"])
    sides = [("engine_s", "phyai-ray, batched per step"), ("diffusers_one_batch_s", "diffusers, one N-prompt call"),
             ("diffusers_sequential_s", "diffusers, once per request")]
    width = 0.8 / len(sides)
    for k, (key, label) in enumerate(sides):
        rates.bar([i + k * width for i in range(len(rows))], [r["n"] / r[key] for r in rows], width, label=label)
    rates.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [f"N = {r['n']}" for r in rows])
    rates.set_ylabel("requests/s (8 steps, CFG, latents)")
    rates.legend(fontsize=7)
    if tables.get("ray"):
        layouts = fig.add_subplot(1, 2, 2)
        ray = tables["ray"]
        labels = [f"{r['layout']}\n({r['case']})" for r in ray]
        layouts.bar(range(len(ray)), [r["median_s"] for r in ray], 0.6)
        layouts.set_xticks(range(len(ray)), labels, fontsize=7)
        layouts.set_ylabel("one request, seconds (Ray, gloo)")


def plot_loop(tables: dict, fig: Any) -> None:
    """Host and forward ms per iteration (p50) against the sequences that run together, per case."""
    ax = fig.add_subplot(1, 1, 1)
    for case, rows in _by(tables["loop"], "case").items():
        rows = sorted(rows, key=lambda r: r["sequences"])
        xs = [r["sequences"] for r in rows]
        line, = ax.plot(xs, [r["host_p50_ms"] for r in rows], marker="o", label=f"{case}: host")
        ax.plot(xs, [r["forward_p50_ms"] for r in rows], marker="x", linestyle="--", color=line.get_color(),
                label=f"{case}: forward")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequences submitted together (each case runs as many at once as its admission allows)")
    ax.set_ylabel("ms per iteration (p50)")
    ax.legend(fontsize=6)


def plot_goodput(tables: dict, fig: Any) -> None:
    """benchmarks/loadgen.py: each request's latency against its arrival time, per class, its SLO drawn;
    errors at the top. Beside it, each class's goodput and attainment."""
    ax, bars = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for k, (cls, rows) in enumerate(_by(tables["requests"], "cls").items()):
        answered = [r for r in rows if r["latency_s"] is not None]
        color = f"C{k}"
        ax.scatter([r["at_s"] for r in answered], [1e3 * r["latency_s"] for r in answered], s=6, color=color,
                   label=f"{cls} ({sum(r['met'] for r in rows)}/{len(rows)} met)")
        if rows[0]["slo_s"]:
            ax.axhline(1e3 * rows[0]["slo_s"], color=color, linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("arrival (s into the trace)")
    ax.set_ylabel("latency (ms); dashed: the class's SLO")
    ax.legend(fontsize=8)
    classes = tables["classes"]
    bars.bar(range(len(classes)), [r["goodput"] for r in classes], color=[f"C{k}" for k in range(len(classes))])
    bars.set_xticks(range(len(classes)), [f"{r['cls']}\n{100 * (r['attainment'] or 0):.0f}% met" for r in classes])
    bars.set_ylabel("goodput (requests/s within their SLO)")


def plot_affinity(tables: dict, fig: Any) -> None:
    """bench_affinity.py: tokens/s and p99 latency per routing on GRPO traffic."""
    rows = tables["affinity"]
    rate, tail = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    names = [r["routing"] for r in rows]
    rate.bar(names, [r["tokens_s"] for r in rows], color=["C0", "C1"][:len(rows)])
    rate.set_ylabel("tokens/s")
    tail.bar(names, [1e3 * r["p99_s"] for r in rows], color=["C0", "C1"][:len(rows)])
    tail.set_ylabel("p99 request latency (ms)")


PLOTS: dict[str, Callable[[dict, Any], None]] = {"affinity": plot_affinity,"goodput_robots": plot_goodput, "goodput_wan": plot_goodput,"batching": plot_batching, "generation": plot_generation,
                                                 "fleet": plot_fleet, "fleet_deadline": plot_fleet_deadline,
                                                 "load": plot_load, "world": plot_world, "loop": plot_loop}


def plot_file(path: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Draw one results file into out/<benchmark>.png; a benchmark without a plot here is an error."""
    doc = json.loads(path.read_text())
    bench = doc.get("benchmark")
    if bench not in PLOTS:
        raise ValueError(f"{path}: benchmark {bench!r} has no plot; plotted: {sorted(PLOTS)}")
    fig = plt.figure(figsize=(10 if bench in ("fleet", "fleet_deadline", "world") else 7, 4.2))
    PLOTS[bench](doc["tables"], fig)
    fig.suptitle(f"{bench}: {doc.get('machine', 'machine not named')}", fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{bench}.png"
    fig.savefig(target, dpi=90)
    plt.close(fig)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=pathlib.Path, help="JSON written by a benchmark's --json")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/benchmarks"))
    opts = parser.parse_args(argv)
    for path in opts.files:
        print(plot_file(path, opts.out))


if __name__ == "__main__":
    main()
