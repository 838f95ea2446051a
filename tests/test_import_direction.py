"""Imports run one way: `actors` -> `phyai_ray` -> `placement`.

* `placement` is pure: it imports neither `phyai_ray`, `actors` nor Ray (not even lazily).
* `phyai_ray` never imports `actors`: the Ray backend registers itself through the
  `phyai_ray.backends` entry point (phyai_ray/executors/backends.py), loaded only when a Ray mode is
  asked for, so Ray is imported only when a Ray-backed engine is built.

Read from the source with `ast`, so a lazy import inside a function counts too. Also: no module of
the three packages grows past MAX_MODULE_LINES.

Inside `phyai_ray`, by dotted module name (lazy imports count here too):

* nothing below the engine imports the trainer's side: `phyai_ray/engine*.py`, `executors/`, the rank
  room `rank/` and the plugins under `models/` never import `phyai_ray.rl` (`rl` imports them);
* edges and runtimes import no plugin: nothing in `serve/` (the HTTP / gRPC edges) or `llm/` (the LLM
  runtime the plugins share) imports `phyai_ray.models`;

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


def _module_name(path: Path) -> str:
    """phyai_ray/rank/runner.py -> phyai_ray.rank.runner; a package's __init__.py -> the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dotted_imports(path: Path) -> set[str]:
    """Dotted names `path` imports anywhere (lazy ones too); `from a.b import c` gives a.b and a.b.c."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _importers_of(prefix: str, paths: list[Path]) -> dict[str, list[str]]:
    """{module: the names it imports at or below `prefix`} for each path that imports any."""
    found = {}
    for path in paths:
        hits = sorted(n for n in _dotted_imports(path) if n == prefix or n.startswith(prefix + "."))
        if hits:
            found[str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)] = hits
    return found


def test_placement_imports_nothing_of_ours_and_no_ray():
    offenders = {str(p.relative_to(ROOT)): sorted(_imports(p) & {"phyai_ray", "actors", "ray"})
                 for p in _modules("placement")}
    assert not {k: v for k, v in offenders.items() if v}


def test_phyai_ray_never_imports_actors_and_the_ray_backend_registers_itself():
    users = [str(p.relative_to(ROOT)) for p in _modules("phyai_ray") if "actors" in _imports(p)]
    assert users == []
    from phyai_ray.executors.backends import backend

    assert backend("local").start.__module__ == "actors.launch" and backend("cluster") == backend("local")


def test_the_check_sees_lazy_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from actors.launch import start_replicas\n    import ray.util\n")
    assert _imports(probe) == {"actors", "ray"}


def test_nothing_below_the_engine_imports_the_trainers_side():
    below = sorted((ROOT / "phyai_ray").glob("engine*.py")) + [p for sub in ("executors", "rank", "models")
                                                  for p in _modules(f"phyai_ray/{sub}")]
    offenders = _importers_of("phyai_ray.rl", below)
    assert not offenders, f"these import phyai_ray.rl (move what they need below it, e.g. to phyai_ray.rank): {offenders}"


def test_edges_and_runtimes_import_no_plugin():
    paths = _modules("phyai_ray/serve") + _modules("phyai_ray/llm")
    offenders = _importers_of("phyai_ray.models", paths)
    assert not offenders, ("these import a plugin; what they need belongs in a runtime room (phyai_ray.llm, "
                           f"phyai_ray.nn) or comes through the plugin's Entry: {offenders}")


def test_the_dotted_check_sees_lazy_and_from_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from phyai_ray import rl\ndef f():\n    from phyai_ray.rl.sender import WeightSender\n")
    assert _importers_of("phyai_ray.rl", [probe]) == {str(probe): ["phyai_ray.rl", "phyai_ray.rl.sender",
                                                                    "phyai_ray.rl.sender.WeightSender"]}


MAX_MODULE_LINES = 450  # about 400 is the aim; generated gRPC stubs are exempt


def test_no_module_of_the_packages_grows_past_the_limit():
    long = {str(p.relative_to(ROOT)): n for package in ("phyai_ray", "actors", "placement") for p in _modules(package)
            if "grpc_v2" not in p.parts and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by what they do): {long}"
