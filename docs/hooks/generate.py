"""mkdocs hook: pages that say `<!-- generated: cli -->` or `<!-- generated: config -->` get text made
from the code itself (the argparse parser of `phyai-ray`, the pydantic config models), so the
reference never drifts from what the code accepts.

    mkdocs build --strict        # mkdocs.yml names this file under `hooks:`

Neither import starts Ray or loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import re
import typing
from typing import Any

# The config models of the reference page, in the order a reader meets them.
CONFIG_MODELS = (
    "phyai_ray.config.engine:EngineArgs",
    "phyai_ray.config.engine:EngineConfig",
    "phyai_ray.config.engine:DeviceConfig",
    "phyai_ray.config.parallel:ParallelConfig",
    "phyai_ray.config.parallel:OuterParallelConfig",
    "phyai_ray.config.parallel:DenseParallelConfig",
    "phyai_ray.config.parallel:AttentionParallelConfig",
    "phyai_ray.config.parallel:MoeParallelConfig",
    "phyai_ray.config.deployment:DeploymentConfig",
    "phyai_ray.config.deployment:WorkerSupervisorConfig",
    "phyai_ray.config.deployment:PlacementSpec",
    "phyai_ray.config.batching:BatchingConfig",
    "phyai_ray.serve.runtime.options:ServeOptions",
)


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _type(annotation: Any) -> str:
    """`int`, `'cpu' | 'cuda' | 'auto'`, `DenseParallelConfig | None`: module paths dropped, Literal values kept."""
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(repr(value) for value in typing.get_args(annotation))
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(annotation))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return f"`{field.default_factory.__name__}()`"
    return "required" if field.is_required() else f"`{field.default!r}`"


def config_markdown() -> str:
    """One table per config model: field, type, default, the field's own description."""
    parts = []
    for path in CONFIG_MODELS:
        model = _load(path)
        doc = (model.__doc__ or "").strip().split("\n\n")[0]
        rows = ["| field | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            rows.append(f"| `{name}` | `{_cell(_type(field.annotation))}` | {_cell(_default(field))} "
                        f"| {_cell(field.description or '')} |")
        parts.append(f"## `{model.__name__}`\n\n`{path.replace(':', '.')}`: {_cell(doc)}\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its sub-commands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_markdown() -> str:
    """`phyai-ray --help` and each sub-command's `--help`, as argparse prints them (80 columns)."""
    import os

    from phyai_ray.cli import build_parser

    os.environ["COLUMNS"] = "100"
    parser = build_parser()
    parts = [f"## `phyai-ray`\n\n```text\n{parser.format_help()}```"]
    for name, sub in _subparsers(parser).items():
        parts.append(f"## `phyai-ray {name}`\n\n```text\n{sub.format_help()}```")
    return "\n\n".join(parts)


GENERATORS = {"<!-- generated: cli -->": cli_markdown, "<!-- generated: config -->": config_markdown}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for marker, make in GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
