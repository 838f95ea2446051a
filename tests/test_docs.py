"""The documentation site builds with --strict, and every Python block it marks runnable runs.

    .venv/bin/python -m pytest tests/test_docs.py -q

A block is runnable when the line before its ```python fence is `<!-- run -->`. The blocks of one
page run in order in one namespace (a later block may use what an earlier one defined); every page
gets a namespace of its own, all in one fresh interpreter, so a snippet cannot lean on this test's
imports. Nothing is skipped: a marker not followed by a python fence fails the test that finds it.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARK = "<!-- run -->"
FENCE = re.compile(r"^```python\s*$")


def runnable_blocks(text: str, where: str) -> list[str]:
    """The code of each block marked runnable, in page order; a marker without a python fence raises."""
    lines, blocks = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
            raise ValueError(f"{where}:{i + 1}: {MARK} must be followed by a ```python fence, got "
                             f"{lines[i + 1] if i + 1 < len(lines) else 'the end of the file'!r}")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{where}:{i + 2}: the python block marked runnable is never closed")
        blocks.append("\n".join(lines[i + 2:end]))
    return blocks


PAGES = sorted(p for p in DOCS.rglob("*.md") if any(line.strip() == MARK for line in p.read_text().splitlines()))


def test_marker_rules_fail_loudly():
    assert runnable_blocks(f"{MARK}\n```python\nx = 1\n```\n", "t.md") == ["x = 1"]
    with pytest.raises(ValueError, match="must be followed by a ```python fence"):
        runnable_blocks(f"{MARK}\n```bash\nls\n```\n", "t.md")
    with pytest.raises(ValueError, match="never closed"):
        runnable_blocks(f"{MARK}\n```python\nx = 1\n", "t.md")


def test_some_pages_carry_runnable_blocks():
    assert len(PAGES) >= 3, f"expected runnable snippets on several pages, found {PAGES}"


# Runs every page's blocks in ONE interpreter (torch and the package load once), each page in a namespace
# of its own; prints one JSON line per page: {"page": ..., "error": null or the traceback}.
DRIVER = """
import json, sys, traceback
for page, script in json.load(sys.stdin):
    try:
        exec(compile(script, page, "exec"), {"__name__": "__main__"})
        error = None
    except BaseException:
        error = traceback.format_exc()[-3000:]
    print("PAGE-RESULT " + json.dumps({"page": page, "error": error}), flush=True)
"""


@pytest.fixture(scope="module")
def page_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    scripts = []
    for page in PAGES:
        blocks = runnable_blocks(page.read_text(), str(page.relative_to(ROOT)))
        scripts.append((str(page.relative_to(DOCS)), "\n\n".join(f"# --- block {k}\n{code}" for k, code in enumerate(blocks))))
    done = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(scripts), cwd=ROOT, capture_output=True,
                          text=True, timeout=240, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                       "OMP_NUM_THREADS": "1",
                                                       "HOME": str(tmp_path_factory.mktemp("home"))})
    found = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("PAGE-RESULT ")]
    assert len(found) == len(scripts), f"the snippet driver stopped early (rc {done.returncode}):\n{done.stderr[-3000:]}"
    return {r["page"]: r["error"] for r in found}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_runnable_blocks_run(page: pathlib.Path, page_results: dict[str, str | None]):
    error = page_results[str(page.relative_to(DOCS))]
    assert error is None, f"docs/{page.relative_to(DOCS)}: its runnable blocks failed:\n{error}"


def test_site_builds_strict(tmp_path: pathlib.Path):
    # no -q: mkdocs --strict counts only the warnings it logs, and -q logs none
    mkdocs = pathlib.Path(sys.executable).with_name("mkdocs")
    done = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, env={"PATH": "/usr/bin:/bin",
                                                                            "NO_MKDOCS_2_WARNING": "1",
                                                                            "HOME": str(tmp_path)})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("phyai_ray.engine.Engine", "phyai_ray.config.engine.EngineArgs", "phyai_ray.rl.actor.EngineActor",
                 "phyai_ray.rl.sender.WeightSender", "phyai_ray.plugins.entry.Entry",
                 "phyai_ray.plugins.iteration.SequenceSpec", "phyai_ray.plugins.iteration.Delta"):
        assert f'id="{name}"' in api, f"the API reference lacks {name}"
    config = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "max_queued_requests" in config and "BatchingConfig" in config
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--dense-tp-size" in cli and "phyai-ray serve" in cli


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_json_plots(tmp_path: pathlib.Path):
    """results.record / write make the JSON plot.py draws; the committed files plot, one PNG each."""
    plot, results = (_load(f"docs_bench_{name}", ROOT / "benchmarks" / f"{name}.py") for name in ("plot", "results"))
    results.record("goodput", policy="deadline", robots=4, goodput=80.0, on_time=1.0)
    results.record("goodput", policy="deadline", robots=8, goodput=160.0, on_time=1.0)
    results.write(str(tmp_path / "fleet.json"), "fleet", "test machine")
    written = plot.plot_file(tmp_path / "fleet.json", tmp_path / "png")
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TypeError, match="not a number or a string"):
        results.record("goodput", policy=object())
    for path in sorted((DOCS / "benchmarks" / "data").glob("*.json")):
        assert plot.plot_file(path, tmp_path / "committed").stat().st_size > 1000
    assert {p.name for p in (tmp_path / "committed").iterdir()} >= {"batching.png", "generation.png", "fleet.png",
                                                                     "world.png"}
    for name in ("batching", "generation", "fleet", "load", "world"):
        assert (DOCS / "benchmarks" / f"{name}.png").exists(), f"docs/benchmarks/{name}.png: run benchmarks/plot.py"
