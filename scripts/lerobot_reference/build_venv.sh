#!/usr/bin/env bash
# Builds the LeRobot 0.4.4 reference venvs (Python 3.11, torch<2.11) used only to regenerate
# tests/data/lerobot/; the tests never need them. LeRobot 0.4.4 is the last release for Python 3.11.
#   /tmp/lerobot-venv          lerobot[smolvla]==0.4.4 (transformers 4.57+ <5): SmolVLA
#   /tmp/lerobot-openpi-venv   the same plus the transformers-openpi==4.53.3 overlay (it installs as
#                              `transformers`, with the Gemma adaptive RMSNorm pi0 / pi0.5 need)
# Each is built once; delete its folder to rebuild it. About 4.4 GB of CUDA wheels each (they run on CPU).
set -euo pipefail
PY311=${PY311:-python3.11}
VENV=${LEROBOT_VENV:-/tmp/lerobot-venv}
VENV_OPENPI=${LEROBOT_OPENPI_VENV:-/tmp/lerobot-openpi-venv}

build() {  # build DIR [overlay requirement]
    local dir=$1 overlay=${2:-}
    if [ -f "$dir/.installed" ]; then return; fi
    [ -x "$dir/bin/python" ] || "$PY311" -m venv "$dir"
    "$dir/bin/pip" install -q "lerobot[smolvla]==0.4.4" "torch<2.11" "safetensors"
    if [ -n "$overlay" ]; then  # over transformers 4.57's files (its metadata stays: LeRobot checks it)
        "$dir/bin/pip" install -q --no-deps --force-reinstall "$overlay"
        "$dir/bin/pip" install -q "tokenizers>=0.21,<0.22"  # what transformers-openpi 4.53.3 imports with
    fi
    touch "$dir/.installed"
}

build "$VENV"
build "$VENV_OPENPI" "transformers-openpi==4.53.3"
