"""Environment registry: ``@agentrl.environment("name")`` tags, ``agentrl.make`` builds.

Environments in other pip packages register through the ``agentrl.environments`` entry-point
group (``name = "module:ClassOrFactory"``), loaded lazily on the first unknown-name lookup.
A duplicate name is an error; an unknown name's error lists what is registered.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "agentrl.environments"
_REGISTRY: dict[str, Callable[..., Any]] = {}
_entry_points_loaded = False
T = TypeVar("T")


class UnknownEnvironmentError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def environment(name: str) -> Callable[[T], T]:
    """Register a class or factory under ``name``."""

    def register(obj: T) -> T:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not obj:
            where = f"{getattr(existing, '__module__', '?')}.{getattr(existing, '__qualname__', '?')}"
            raise ValueError(f"environment {name!r} is already registered by {where}")
        _REGISTRY[name] = obj  # type: ignore[assignment]
        if isinstance(obj, type):
            obj.env_name = name  # type: ignore[attr-defined]
        return obj

    return register


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception:
            log.warning("could not load environment entry point %s = %s", ep.name, ep.value, exc_info=True)
            continue
        if ep.name not in _REGISTRY:
            environment(ep.name)(obj)


def lookup(name: str) -> Callable[..., Any]:
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY and "." not in name:
        # Built-in environments live in the top-level `environments` package.
        try:
            importlib.import_module(f"environments.{name}")
        except ImportError:
            pass
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}; registered: {known}. Import the module that defines it "
            f"(e.g. `import my_envs`) or pip install the package that provides it "
            f"(it registers through the {ENTRY_POINT_GROUP!r} entry-point group)."
        )
    return _REGISTRY[name]


def make(name: str, **config: Any) -> Any:
    """Build the environment registered under ``name`` with ``config`` as keyword arguments."""
    return lookup(name)(**config)


def registered() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)
