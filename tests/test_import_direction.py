"""Imports run one way: `phyai_ray` -> `actors` -> `placement`, through one door.

* `placement` is pure: it imports neither `phyai_ray`, `actors` nor Ray (not even lazily).
* `phyai_ray` reaches `actors` in exactly one module, `phyai_ray/executors/__init__.py` (the
  executor factory), so Ray is imported only when a Ray-backed engine is built.

Read from the source with `ast`, so a lazy import inside a function counts too.

Run: .venv/bin/pytest tests/test_import_direction.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Top-level package names imported anywhere in `path` (module level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_placement_imports_nothing_of_ours_and_no_ray():
    offenders = {str(p.relative_to(ROOT)): sorted(_imports(p) & {"phyai_ray", "actors", "ray"})
                 for p in _modules("placement")}
    assert not {k: v for k, v in offenders.items() if v}


def test_phyai_ray_reaches_actors_through_one_module():
    users = [str(p.relative_to(ROOT)) for p in _modules("phyai_ray") if "actors" in _imports(p)]
    assert users == ["phyai_ray/executors/__init__.py"]


def test_the_check_sees_lazy_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from actors.launch import start_replicas\n    import ray.util\n")
    assert _imports(probe) == {"actors", "ray"}
