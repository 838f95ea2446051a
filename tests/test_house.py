"""The house rules, read from the source with `ast` (no import of the code under test):

* **Layers live in `phyai_ray/nn/`.** Outside it no module defines a norm, a rotary embedding, an
  attention function or a tensor-parallel split, and no module calls the primitives they are made of:
  `scaled_dot_product_attention` (or diffusers' `dispatch_attention_fn`), `layer_norm` / `rms_norm` /
  `group_norm`, `rsqrt`, the score product
  `q @ k.transpose(-1, -2)`, and collectives over a tensor- or context-parallel group (`"*_tp"`,
  `"*_cp"`). A model file wires layers; a new kernel or an accumulation fix then lands once.
* **No class is spread over files.** A class whose methods read `self.<name>` that neither it nor its
  bases (resolved inside the three packages) define lives partly in the class that inherits it: a
  mixin half. Such a class is a collaborator given what it uses, or part of its host's file.
* **No docstring or comment names a source file that does not exist** (a path ending in `.py`
  under the three packages, `tests/`, `benchmarks/` and `examples/`).

The import rules of the design contract are `tests/test_import_direction.py`.

Run: .venv/bin/pytest tests/test_house.py -q
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("phyai_ray", "actors", "placement")
LAYERS = ROOT / "phyai_ray" / "nn"

# a defined name that is a layer: rms_norm, RMSNorm, LayerNorm, rope, apply_rope, rotary, rotate, a parallel linear.
# A model's attention MODULE (projections wired around nn's attention entry) may be named for what it is; the
# attention function itself is found by what it computes (the primitives and the score product below).
LAYER_NAME = re.compile(r"(^|_)(rms_?norm|layer_?norm|group_?norm|norm|rope|rotary|rotate|rotate_half)($|_)"
                        r"|RMSNorm|LayerNorm|Rotary|ParallelLinear|^Split$", re.IGNORECASE)
PRIMITIVES = frozenset({"scaled_dot_product_attention", "dispatch_attention_fn", "layer_norm", "rms_norm",
                        "group_norm", "rsqrt"})
COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})
SPLIT_GROUP = re.compile(r"_(tp|cp)$")


def _modules(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py") if "grpc_v2" not in p.parts)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _is_score_product(node: ast.AST) -> bool:
    """`a @ b.transpose(-1, -2)` / `a @ b.transpose(-2, -1)` / `a @ b.mT`: attention scores."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult)):
        return False
    right = node.right
    if isinstance(right, ast.Attribute) and right.attr == "mT":
        return True
    if isinstance(right, ast.Call) and _call_name(right) == "transpose" and len(right.args) == 2:
        dims = {ast.literal_eval(a) for a in right.args if isinstance(a, (ast.Constant, ast.UnaryOp))}
        return dims == {-1, -2}
    return False


def _split_collective(node: ast.Call) -> str | None:
    """The group of a collective over a tp / cp group (`P.all_reduce(x, "dense_tp")`), else None."""
    if _call_name(node) not in COLLECTIVES:
        return None
    for arg in [*node.args, *(k.value for k in node.keywords if k.arg == "group")]:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and SPLIT_GROUP.search(arg.value):
            return arg.value
    return None


def _from_layers(tree: ast.AST) -> set[str]:
    """Local names bound to the layers room: `from phyai_ray.nn.norm import rms_norm` binds rms_norm,
    `from phyai_ray.nn import norm` / `import phyai_ray.nn.norm as norm` bind norm."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("phyai_ray.nn"):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.asname for alias in node.names if alias.asname and alias.name.startswith("phyai_ray.nn")}
    return names


def _calls_the_room(node: ast.Call, room: set[str]) -> bool:
    """A call of one of nn's own layers (`rms_norm(...)` imported from nn, `norm.layer_norm(...)`)."""
    f = node.func
    return (isinstance(f, ast.Name) and f.id in room) or (
        isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in room)


def layer_findings(path: Path) -> list[str]:
    """What in `path` is a layer (definition or primitive) that belongs in phyai_ray/nn/. Calling nn's own
    layers by their names (`rms_norm` from phyai_ray.nn.norm) is what a model file should do."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    room = _from_layers(tree)
    for node in ast.walk(tree):
        where = f"{_rel(path)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and LAYER_NAME.search(node.name):
            found.append(f"{where} defines {node.name}")
        elif isinstance(node, ast.Call) and _call_name(node) in PRIMITIVES and not _calls_the_room(node, room):
            found.append(f"{where} calls {_call_name(node)}")
        elif isinstance(node, ast.Call) and (group := _split_collective(node)):
            found.append(f"{where} splits over {group}")
        elif _is_score_product(node):
            found.append(f"{where} computes attention scores")
    return found


def test_layers_live_only_in_nn():
    outside = [p for p in _modules("phyai_ray", "actors") if not p.is_relative_to(LAYERS)]
    found = [f for p in outside for f in layer_findings(p)]
    assert not found, ("layers outside phyai_ray/nn/ (build them from nn's norms, rotary, attention entry and "
                       "parallel linears, or add what is missing there once):\n  " + "\n  ".join(found))


def test_the_layer_check_sees_each_kind(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch.nn.functional as F\n"
        "def rms_norm(x, w): return x * torch.rsqrt(x)\n"
        "class RotaryEmbedding: pass\n"
        "def f(q, k, v):\n"
        "    s = q @ k.transpose(-2, -1)\n"
        "    P.all_reduce(v, 'dense_tp')\n"
        "    P.all_gather(v, group='cfg')\n"
        "    return F.scaled_dot_product_attention(q, k, v)\n"
        "def normalize(x): return x\n"
        "from phyai_ray.nn.norm import rms_norm as rms_norm\n"
        "from phyai_ray.nn import norm\n"
        "def g(x, w):\n"
        "    return norm.layer_norm(rms_norm(x, w, 1e-6))\n")
    kinds = [f.split(" ", 1)[1] for f in layer_findings(probe)]
    assert sorted(kinds) == sorted(["defines rms_norm", "calls rsqrt", "defines RotaryEmbedding",
                                    "computes attention scores", "splits over dense_tp",
                                    "calls scaled_dot_product_attention"])


# -- classes in halves ------------------------------------------------------------------------------

class _ClassInfo:
    def __init__(self, node: ast.ClassDef, path: Path) -> None:
        self.node, self.path, self.name = node, path, node.name
        self.bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                      for b in node.bases]
        self.defined: set[str] = set()
        self.read: dict[str, int] = {}
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(item.name)
            elif isinstance(item, ast.Assign):
                self.defined |= {t.id for t in item.targets if isinstance(t, ast.Name)}
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                self.defined.add(item.target.id)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                if isinstance(sub.ctx, (ast.Store, ast.Del)):
                    self.defined.add(sub.attr)
                else:
                    self.read.setdefault(sub.attr, sub.lineno)
            elif isinstance(sub, ast.Call) and _call_name(sub) == "setattr" and sub.args \
                    and isinstance(sub.args[0], ast.Name) and sub.args[0].id == "self":
                self.defined.add("*")  # dynamic attributes: nothing can be said


OBJECT_ATTRS = frozenset(dir(object)) | {"__class__", "__dict__"}
NEUTRAL_BASES = frozenset({"object", "Generic", "Protocol", "ABC"})


def _classes(paths: list[Path]) -> dict[str, list[_ClassInfo]]:
    found: dict[str, list[_ClassInfo]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(_ClassInfo(node, path))
    return found


def _provided(info: _ClassInfo, classes: dict[str, list[_ClassInfo]], seen: set[str]) -> set[str] | None:
    """Every name `info` and its bases define, or None when a base is outside the packages (unknowable)."""
    names = set(info.defined)
    for base in info.bases:
        if base in NEUTRAL_BASES or (base in seen):
            continue
        if base not in classes or len(classes[base]) != 1:
            return None
        more = _provided(classes[base][0], classes, seen | {base})
        if more is None:
            return None
        names |= more
    return names


def half_classes(paths: list[Path]) -> list[str]:
    """Classes reading `self.x` that neither they nor their bases define: halves of a class elsewhere."""
    classes = _classes(paths)
    found = []
    for infos in classes.values():
        for info in infos:
            provided = _provided(info, classes, {info.name})
            if provided is None or "*" in provided:
                continue
            missing = sorted(set(info.read) - provided - OBJECT_ATTRS)
            if missing:
                found.append(f"{_rel(info.path)}:{info.node.lineno} {info.name} reads {', '.join(missing)} "
                             "defined only by the classes that inherit it")
    return found


def test_no_class_lives_in_more_than_one_file():
    found = half_classes(_modules(*PACKAGES))
    assert not found, ("classes in halves (give the collaborator what it uses, or join it to its host):\n  "
                       + "\n  ".join(found))


def test_the_half_class_check_sees_a_mixin(tmp_path):
    (tmp_path / "a.py").write_text("class Mixin:\n    def poke(self):\n        return self._queue.pop()\n")
    (tmp_path / "b.py").write_text(
        "from a import Mixin\n"
        "class Host(Mixin):\n    def __init__(self):\n        self._queue = []\n"
        "class Whole:\n    size: int = 0\n    def __init__(self):\n        self.x = 1\n"
        "    def f(self):\n        return self.x + self.size + self.g()\n    def g(self):\n        return 0\n"
        "class Foreign(dict):\n    def f(self):\n        return self.anything\n")
    found = half_classes([tmp_path / "a.py", tmp_path / "b.py"])
    assert len(found) == 1 and "Mixin reads _queue" in found[0]


# -- docstrings name files that exist ---------------------------------------------------------------

FILE_NAME = re.compile(r"\b((?:phyai_ray|actors|placement|tests|benchmarks|examples|[a-z_]+)/[\w/]*\w\.py)\b")


def _named_files(path: Path) -> list[tuple[int, str]]:
    named = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        named += [(i, m.group(1)) for m in FILE_NAME.finditer(line)]
    return named


def _exists(name: str, path: Path) -> bool:
    """A named file exists from the repository root, from phyai_ray/, or beside the module naming it."""
    return any((base / name).exists() for base in (ROOT, ROOT / "phyai_ray", path.parent, path.parent.parent))


def test_no_source_names_a_file_that_does_not_exist():
    missing = [f"{_rel(p)}:{i} names {name}" for p in _modules(*PACKAGES, "tests", "benchmarks", "examples")
               for i, name in _named_files(p) if not _exists(name, p) and "tmp" not in name]
    assert not missing, "sources name files that do not exist:\n  " + "\n  ".join(missing)
