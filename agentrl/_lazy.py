"""Lazy package exports: ``from agentrl.router import Router`` works, while ``import agentrl.router.config``
(what the CLI does to parse settings) does not pull in aiohttp, numpy or torch; and the other side of
it, :func:`import_ahead`: a heavy import started early, while the process waits on something else."""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)


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


_AHEAD: dict[str, threading.Thread] = {}


def import_ahead(module: str, *names: str) -> None:
    """Import ``module`` (and its ``names``: a lazy package loads each on first use) in a daemon
    thread, e.g. transformers while vLLM engines start. Only imports, nothing to undo; a failure is
    left to the code that imports it for real, which reports it with its own context. Code that
    imports it for real calls :func:`imported_ahead` first: a lazy package's first loads are not
    safe from two threads at once (transformers answered "cannot import name 'AutoTokenizer'" to
    the router of a serve whose engines were already running)."""

    def load() -> None:
        try:
            loaded = importlib.import_module(module)
            for name in names:
                getattr(loaded, name)
        except Exception as e:
            log.debug("importing %s ahead failed: %s", module, e)

    thread = _AHEAD[module] = threading.Thread(target=load, name=f"import-{module}", daemon=True)
    thread.start()


def imported_ahead(module: str, timeout_s: float = 300.0) -> None:
    """Wait until an :func:`import_ahead` of ``module`` under way has finished (none: return)."""
    thread = _AHEAD.get(module)
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout_s)
