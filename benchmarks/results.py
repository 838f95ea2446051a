"""What a benchmark printed, kept as JSON for `benchmarks/plot.py` (`--json PATH` on each script).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_fleet.py --json results/fleet.json
    .venv/bin/python benchmarks/plot.py results/*.json --out docs/benchmarks

A script calls `record(table, **row)` where it prints a row and `write(path, benchmark, machine)`
once at the end. The file: {"benchmark": "fleet", "machine": "...", "written": "2026-...Z",
"tables": {"goodput": [{"policy": "deadline", "robots": 8, "on_time": 1.0, ...}, ...]}}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
from typing import Any

_TABLES: dict[str, list[dict[str, Any]]] = {}


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the printed results as JSON to PATH (benchmarks/plot.py draws them)")


def record(table: str, **row: Any) -> None:
    """Keep one printed row of `table` (plain numbers and strings)."""
    _TABLES.setdefault(table, []).append({k: _plain(v) for k, v in row.items()})


def _plain(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"results.record: {value!r} ({type(value).__name__}) is not a number or a string; "
                        "record plain values") from None


def write(path: str | None, benchmark: str, machine: str) -> None:
    """Write every recorded table to `path` (nothing when `path` is None)."""
    if path is None:
        return
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    doc = {"benchmark": benchmark, "machine": machine, "written": stamp, "tables": _TABLES}
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"results written to {target}", flush=True)


def machine() -> str:
    """The machine a benchmark ran on: platform, CPU model, cores, torch and its intra-op threads (the
    defaults a user gets unless the script set them). Imports no Ray."""
    import torch

    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   cpu)
    return f"{platform.platform()}, {cpu}, {os.cpu_count()} cores, torch {torch.__version__} " \
           f"({torch.get_num_threads()} intra-op threads)"


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile of `values` (the value at rank q x n of the sorted list); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]
