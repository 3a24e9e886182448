"""Lazy package exports: ``from agentrl.router import Router`` works, while ``import agentrl.router.config``
(what the CLI does to parse settings) does not pull in aiohttp, numpy or torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` that import ``exports[name]`` (a module path) on first use."""
    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
