"""`actors` and `placement` are top-level packages of THIS distribution (both names exist on PyPI too).

Run: .venv/bin/pytest tests/test_packaging.py -q
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("phyai_ray", "actors", "placement")


@pytest.mark.parametrize("name", PACKAGES)
def test_package_resolves_to_this_repository(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, f"{name} is missing or a namespace package"
    assert Path(spec.origin) == ROOT / name / "__init__.py"


@pytest.mark.parametrize("name", PACKAGES)
def test_only_phyai_ray_provides_the_package(name):
    # the same distribution may be listed more than once (editable install plus the in-tree egg-info)
    assert set(metadata.packages_distributions().get(name, [])) == {"phyai-ray"}
    assert name in metadata.distribution("phyai-ray").read_text("top_level.txt").split()


def test_packages_resolve_outside_the_repository(tmp_path):
    code = "import actors, placement, phyai_ray; print(actors.__file__); print(placement.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(ROOT / "actors" / "__init__.py"), str(ROOT / "placement" / "__init__.py")]


def test_pyproject_declares_the_packages_and_plugins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == "phyai-ray"
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {"phyai_ray*", "actors*", "placement*"} <= set(include)
    installed = {ep.name for ep in metadata.entry_points(group="phyai_ray.plugins")}
    assert set(project["project"]["entry-points"]["phyai_ray.plugins"]) <= installed


def test_wheel_contains_all_three_packages(tmp_path):
    """Build the wheel from a copy of the sources (no network, no build isolation) and list it."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."]
    proc = subprocess.run(cmd, cwd=src, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = zipfile.ZipFile(next(tmp_path.glob("phyai_ray-*.whl"))).namelist()
    for package in PACKAGES:
        assert f"{package}/__init__.py" in names
    assert "placement/topology.py" in names and "placement/bundles.py" in names
    assert not [n for n in names if n.startswith("tests/")]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "[phyai_ray.plugins]" in zipfile.ZipFile(next(tmp_path.glob("*.whl"))).read(entry_points).decode()
