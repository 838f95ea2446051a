"""Launch a test script under torchrun and return the finished process.

    proc = torchrun("tests.scripts.collectives_check", [str(tmp_path)], nproc=2)

Runs `python -m torch.distributed.run --standalone` from the repository root (a free rendezvous
port each time), with a bounded timeout; the caller checks returncode and the files it wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def torchrun(module: str, args: list[str], nproc: int = 2, timeout_s: float = 90.0,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout_s)


def torchrun_json(module: str, out_dir: Path, name: str, nproc: int = 2, timeout_s: float = 90.0) -> list:
    """Run `module` under torchrun with `out_dir` as its argument; return each rank's `name.format(rank=r)` JSON."""
    import json

    proc = torchrun(module, [str(out_dir)], nproc=nproc, timeout_s=timeout_s)
    assert proc.returncode == 0, describe(proc)
    return [json.loads((Path(out_dir) / name.format(rank=r)).read_text()) for r in range(nproc)]


def describe(proc: subprocess.CompletedProcess) -> str:
    """The tail of a launch's output, for assertion messages."""
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"


def finish_rank() -> None:
    """End a torchrun rank once its results are written: what the launcher owes its world (a barrier,
    then destroy the default group), then an exit that skips interpreter finalization. There, gloo's
    threads can still free work objects holding Python tensors, which aborts now and then (SIGABRT,
    "terminate called without an active exception") after everything was done."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
