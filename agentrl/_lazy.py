"""Lazy package exports: ``from agentrl.router import Router`` works, while ``import agentrl.router.config``
(what the CLI does to parse settings) does not pull in aiohttp, numpy or torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy(package: str, modules: Mapping[str, Sequence[str]]
         ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """A package's ``__getattr__``, ``__dir__`` and ``__all__`` for the names ``modules`` lists per
    module: each is imported from its module on first use."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__, sorted(where)
