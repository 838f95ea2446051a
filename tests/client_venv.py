"""A venv of its own for third-party clients whose pins the project cannot take.

`tritonclient[grpc]` needs protobuf < 7 and `openpi-client` needs numpy < 2, while Ray and torch
here run on newer ones. `client_python()` builds `.venv-clients/` once (pip from the package
index, with a deadline) and returns its interpreter; tests run the real clients there as
subprocesses (`run_client`) and read one JSON line of results. Nothing of phyai-ray is installed
in it: the clients see the server only through the network, as users' clients do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-clients"
PACKAGES = ("tritonclient[grpc]>=2.40", "openpi-client>=0.1.2")
STAMP = VENV / (".installed-" + "-".join(p.split(">")[0].replace("[", "_").replace("]", "") for p in PACKAGES))
BUILD_TIMEOUT_S = 600


def client_python() -> str:
    """The interpreter of the clients' venv, built on first use."""
    python = VENV / "bin" / "python"
    if not STAMP.exists():
        if not python.exists():
            venv.create(VENV, with_pip=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"installing {PACKAGES} into {VENV} failed:\n{done.stderr[-3000:]}")
        STAMP.touch()
    return str(python)


def run_client(script: str, *args: str, timeout_s: float = 180) -> dict[str, Any]:
    """Run tests/scripts/<script> in the clients' venv; its last stdout line is a JSON object."""
    return json.loads(run_script(REPO / "tests" / "scripts" / script, *args, timeout_s=timeout_s).splitlines()[-1])


def run_script(path: Path, *args: str, timeout_s: float = 180) -> str:
    """Run a Python file in the clients' venv; its stdout (AssertionError with the output if it fails)."""
    done = subprocess.run([client_python(), str(path), *args], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"{path.name} {' '.join(args)} exited {done.returncode}:\n{done.stdout[-2000:]}\n"
                             f"{done.stderr[-4000:]}")
    return done.stdout.strip()


if __name__ == "__main__":
    print(client_python(), file=sys.stderr)
