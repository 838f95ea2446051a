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
* edges and runtimes import no plugin: nothing in `serve/` (the HTTP / gRPC edges), `llm/` (the LLM
  runtime), `nn/` (shared layers) or `policy/` (shared robot-policy checks) imports `phyai_ray.models`;
* plugins import runtimes, never each other: a module under `phyai_ray/models/X/` imports no
  `phyai_ray.models.Y` for Y != X;
* no import cycle between the modules of the three packages, lazy imports counted too: a lazy import
  that hides a cycle still ties the two modules together (move what both need below them instead).

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
    paths = [p for room in ("serve", "llm", "nn", "stepwise") for p in _modules(f"phyai_ray/{room}")]
    offenders = _importers_of("phyai_ray.models", paths)
    assert not offenders, ("these import a plugin; what they need belongs in a runtime room (phyai_ray.llm, "
                           f"phyai_ray.nn) or comes through the plugin's Entry: {offenders}")


def test_plugins_never_import_each_other():
    offenders = {}
    for plugin in sorted(p.name for p in (ROOT / "phyai_ray" / "models").iterdir() if p.is_dir()):
        others = _importers_of("phyai_ray.models", _modules(f"phyai_ray/models/{plugin}"))
        for module, names in others.items():
            foreign = [n for n in names if n.split(".")[2:3] not in ([plugin], [])]
            if foreign:
                offenders[module] = foreign
    assert not offenders, ("plugins import other plugins; move what they share to a runtime room "
                           f"(phyai_ray.llm, phyai_ray.nn, phyai_ray.stepwise): {offenders}")


def test_the_dotted_check_sees_lazy_and_from_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from phyai_ray import rl\ndef f():\n    from phyai_ray.rl.sender import WeightSender\n")
    assert _importers_of("phyai_ray.rl", [probe]) == {str(probe): ["phyai_ray.rl", "phyai_ray.rl.sender",
                                                                    "phyai_ray.rl.sender.WeightSender"]}


def _import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """{module: the modules of `packages` it imports}; `from a import b` points at a.b when b is a module."""
    paths = {_module_name_under(root, p): p for package in packages for p in sorted((root / package).rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                            for a in node.names}
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _module_name_under(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph has none (depth-first, in name order)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        path.append(node)
        for nxt in sorted(graph[node]):
            if found := visit(nxt):
                return found
        path.pop()
        done.add(node)
        return []

    return next((c for node in sorted(graph) if (c := visit(node))), [])


def test_no_import_cycle_between_modules_lazy_imports_included():
    cycle = _a_cycle(_import_graph(ROOT, ("phyai_ray", "actors", "placement")))
    assert not cycle, f"import cycle: {' -> '.join(cycle)}; move what both sides need into a module below them"


def test_the_cycle_check_finds_a_cycle_made_of_lazy_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("def g():\n    from pkg import a\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    graph = _import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert _a_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert _a_cycle({"pkg.a": {"pkg.b"}, "pkg.b": set()}) == []


MAX_MODULE_LINES = 400  # generated gRPC stubs are exempt


def test_no_module_of_the_packages_grows_past_the_limit():
    long = {str(p.relative_to(ROOT)): n for package in ("phyai_ray", "actors", "placement") for p in _modules(package)
            if "grpc_v2" not in p.parts and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by what they do): {long}"
