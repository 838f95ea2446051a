"""Print the real-size plan table of diffusers_pipeline: per-rank bytes, CUDA dtypes, default budget.

    .venv/bin/python scripts/real_size_plans.py                 # the five committed real configs
    .venv/bin/python scripts/real_size_plans.py /path/to/folder  # any folder of config.json files

Every model is built on the meta device from tests/data/real_configs/ (no weights, no memory; the
sources of the configs are in that folder's README.md); phyai_ray/models/diffusers_pipeline/plans.py
says how each rank's bytes are counted. docs/models/diffusers_pipeline.md quotes the output.
"""

from __future__ import annotations

import sys
from pathlib import Path

REAL = Path(__file__).resolve().parent.parent / "tests" / "data" / "real_configs"
NAMES = ("Wan2.1-T2V-1.3B", "Wan2.1-T2V-14B", "Wan2.2-TI2V-5B", "Wan2.2-T2V-A14B", "Cosmos-Predict2.5-2B")


def main(paths: list[str]) -> str:
    from phyai_ray.models.diffusers_pipeline.plans import plan_folder, table

    folders = [Path(p) for p in paths] or [REAL / name for name in NAMES]
    return table([plan_folder(folder) for folder in folders])


if __name__ == "__main__":
    print(main(sys.argv[1:]))
