"""Joins that do not stall the fleet: a running robot's step gaps while 8 others join, with and without
`prefix_budget`, on a pi0-shaped `lerobot_policy` (random weights) on this machine's CPU.

Run: `env PYTHONPATH=. .venv/bin/python benchmarks/bench_joins.py [--rounds 3] [--budget N]`
(no Ray, no LeRobot; bench_policy.py runs it as its part 5.)

One robot's frame runs (60 expert steps); after 5 of them 8 robots' frames join at once. The gap
between two of the running robot's steps is one iteration of the rank: its expert step for every
ready frame plus that iteration's prefix work. Without a budget the 8 prefixes run whole in one
iteration (one stall); with one, an iteration runs prefix layers until the budget is spent, so the
stall is spread thin. A third side runs the robot with no joins: the spread the machine itself puts
on equal iterations. Prints the machine, then per side the gaps' median and p99 and their ratio
(target <= 1.5x) by the wall clock and in the thread's CPU time (what the rank itself spent, without
the time other processes took the core), and the joiners' first-step latency (what the budget costs
them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_policy import machine, pct  # noqa: E402  (beside this script)
from phyai_ray.models.lerobot_policy.entry import LeRobotPolicyEntry  # noqa: E402
from phyai_ray.models.lerobot_policy.folder import PolicyFolder  # noqa: E402
from phyai_ray.models.lerobot_policy.policy import build_network  # noqa: E402

DATA = ROOT / "tests" / "data" / "lerobot" / "pi0"
STEPS, JOINERS = 60, 8


def pi0_shaped(root: Path, steps: int = STEPS) -> dict:
    """The tests' tiny pi0 folder widened to a prefix pass of tens of ms, random weights, `steps` steps."""
    folder = root / "pretrained_model"
    shutil.copytree(DATA / "pretrained_model", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(num_inference_steps=steps, image_resolution=[96, 96])
    (folder / "config.json").write_text(json.dumps(config))
    sizes = json.loads((DATA / "cases.json").read_text())["sizes"]
    sizes["paligemma"].update(width=256, depth=4, mlp_dim=1024, num_heads=4, head_dim=32)
    sizes["action_expert"].update(width=128, depth=4, mlp_dim=512, num_heads=4, head_dim=32)
    sizes["vision"].update(hidden_size=192, num_hidden_layers=4, intermediate_size=768, patch_size=16)
    args = {"model": str(folder), "tokenizer": str(DATA / "backbone"), "sizes": sizes}
    torch.manual_seed(0)
    net = build_network(PolicyFolder.open(args), "cpu")
    save_file({f"model.{k}": v.contiguous() for k, v in net.state_dict().items()}, str(folder / "model.safetensors"))
    return args


def frame(r: int) -> dict:
    gen = torch.Generator().manual_seed(r)
    return {"observation.state": torch.randn(6, generator=gen), "task": f"pick up cube {r}",
            "observation.images.top": torch.rand(3, 96, 96, generator=gen),
            "observation.images.wrist": torch.rand(3, 96, 96, generator=gen)}


def one_run(args: dict, budget: int | None, joiners: int = JOINERS) -> tuple[list[float], list[float], list[float]]:
    """(the running robot's gaps by the wall clock, the same gaps in this thread's CPU time, each
    joiner's time to its first step), in seconds. The CPU time leaves out the time other processes
    of a shared machine took the core: the rank's own work per iteration."""
    entry = LeRobotPolicyEntry({**args, **({"prefix_budget": budget} if budget else {})})
    rank = entry.create({}, SimpleNamespace(device="cpu"))
    frames = [entry.validate_request(frame(r)) for r in range(JOINERS + 1)]
    rank.admit(0, frames[0])
    while rank.running[0].index == 0:
        rank.iterate()
    gaps, cpu, joined_at, first_step = [], [], None, {}
    while 0 in rank.running:
        if rank.running[0].index == 5:
            joined_at = time.perf_counter()
            for r in range(1, joiners + 1):
                rank.admit(r, frames[r])
        began, began_cpu = time.perf_counter(), time.thread_time()
        rank.iterate()
        gaps.append(time.perf_counter() - began)
        cpu.append(time.thread_time() - began_cpu)
        for r in range(1, joiners + 1):
            if joined_at and r not in first_step and r in rank.running and rank.running[r].index:
                first_step[r] = time.perf_counter() - joined_at
    for ident in list(rank.running):
        rank.drop(ident)
    return gaps, cpu, list(first_step.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two sides")
    parser.add_argument("--budget", type=int, default=None, help="prefix_budget (default: one VLM layer of one frame)")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    print(machine(), flush=True)
    print(joins_part(opts.rounds, opts.budget), flush=True)


def joins_part(rounds: int = 3, budget: int | None = None) -> str:
    with tempfile.TemporaryDirectory(prefix="bench-joins-") as tmp:
        args = pi0_shaped(Path(tmp))
        entry = LeRobotPolicyEntry(args)
        per_frame = entry.prefix_cost(entry.validate_request(frame(0))) // entry._layers
        budget = budget or per_frame
        one_run(args, None)  # warm
        got: dict[str, tuple[list[float], ...]] = {side: ([], [], []) for side in ("alone", "whole", "budget")}
        for _ in range(rounds):
            for side, b in (("alone", None), ("whole", None), ("budget", budget)):
                for kept, taken in zip(got[side], one_run(args, b, 0 if side == "alone" else JOINERS)):
                    kept.extend(taken)
    lines = [f"5. joins: 1 robot running {STEPS} steps, {JOINERS} join after 5; pi0-shaped (4 + 4 layers, 2 cameras "
             f"at 96x96, {per_frame} prefix tokens a frame), {rounds} alternating rounds"]
    names = {"alone": "no joins (the machine's own spread)", "whole": "prefixes whole (default)",
             "budget": f"prefix_budget={budget}"}
    for side, (gaps, cpu, first) in got.items():
        med, p99 = statistics.median(gaps) * 1e3, pct(gaps, 99) * 1e3
        cmed, cp99 = statistics.median(cpu) * 1e3, pct(cpu, 99) * 1e3
        joined = (f"; joiners' first step p50 {statistics.median(first) * 1e3:.1f} ms, max {max(first) * 1e3:.1f} ms"
                  if first else "")
        lines.append(f"  {names[side]}: gap p50 {med:.2f} ms, p99 {p99:.2f} ms, p99/p50 {p99 / med:.2f}x "
                     f"({'met' if p99 <= 1.5 * med else 'NOT MET'}: <= 1.5x); in CPU time p50 {cmed:.2f} ms, "
                     f"p99 {cp99:.2f} ms, {cp99 / cmed:.2f}x{joined}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
