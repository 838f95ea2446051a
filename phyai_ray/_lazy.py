"""Lazy package exports (PEP 562): names load from their module on first access."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, loading `name` from `exports[name]` when first used."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


def by_module(table: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """{module: (name, ...)} as {name: module}, the form `lazy_exports` takes."""
    return {name: module for module, names in table.items() for name in names}
