"""Lazy attribute tables for package `__init__` modules: names resolve to their module on first use."""

from __future__ import annotations

import importlib
from typing import Any


def lazy_getattr(package: str, table: dict[str, str]):
    """Return a module `__getattr__` that imports `table[name]` (relative to `package`) and fetches `name` from it."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
