"""Environment registry: ``@agentrl.environment("name")`` tags, ``agentrl.make`` builds.

Three ways a name becomes known, all lazy and all ending in the same table:
- the decorator, when the module that defines the environment is imported;
- the ``agentrl.environments`` entry-point group (``name = "module:ClassOrFactory"``) of any
  installed distribution, so ``pip install my-envs`` is enough; scanned again on every miss, so a
  package installed while the process runs is found too;
- the built-in ``environments`` package: ``environments.<name>`` is imported on a miss.

Invariants: a name maps to exactly one object (registering a different object under a taken name
raises :class:`DuplicateEnvironmentError`; registering the same object again is a no-op, which
makes entry points that point at decorated classes harmless). An unknown name raises
:class:`UnknownEnvironmentError`, which lists what is registered, which entry points failed to
load and why, and what to import or install.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, TypeVar

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "agentrl.environments"
BUILTIN_PACKAGE = "environments"
_REGISTRY: dict[str, Callable[..., Any]] = {}
_FAILED_ENTRY_POINTS: dict[str, str] = {}  # "name = value" -> why it did not load
_LOADED_ENTRY_POINTS: set[tuple[str, str]] = set()
T = TypeVar("T")


class UnknownEnvironmentError(KeyError):
    """No environment is registered under the name asked for."""

    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateEnvironmentError(ValueError):
    """A second, different object tried to register under a taken name."""


def _where(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def environment(name: str) -> Callable[[T], T]:
    """Register a class or factory under ``name`` (a decorator; it only tags and registers)."""
    if not isinstance(name, str) or not name:
        raise ValueError("an environment name must be a non-empty string")

    def register(obj: T) -> T:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not obj:
            raise DuplicateEnvironmentError(
                f"environment {name!r} is already registered by {_where(existing)}; "
                f"{_where(obj)} cannot take the same name. Rename one of them."
            )
        _REGISTRY[name] = obj  # type: ignore[assignment]
        if isinstance(obj, type):
            obj.env_name = name  # type: ignore[attr-defined]
        return obj

    return register


def unregister(name: str) -> None:
    """Forget ``name`` (for tests and notebooks that redefine an environment)."""
    _REGISTRY.pop(name, None)


def _load_entry_point(ep: EntryPoint) -> None:
    key = (ep.name, ep.value)
    if key in _LOADED_ENTRY_POINTS:
        return
    _LOADED_ENTRY_POINTS.add(key)
    try:
        obj = ep.load()
    except Exception as e:  # a broken plug-in must not hide the others
        why = f"{type(e).__name__}: {e}"
        _FAILED_ENTRY_POINTS[f"{ep.name} = {ep.value}"] = why
        log.warning("could not load environment entry point %s = %s (%s)", ep.name, ep.value, why)
        return
    environment(ep.name)(obj)


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            _load_entry_point(ep)
        except DuplicateEnvironmentError as e:
            _FAILED_ENTRY_POINTS[f"{ep.name} = {ep.value}"] = str(e)
            log.warning("%s", e)


def _import_builtin(name: str) -> None:
    try:
        importlib.import_module(f"{BUILTIN_PACKAGE}.{name}")
    except ModuleNotFoundError as e:
        if e.name not in (BUILTIN_PACKAGE, f"{BUILTIN_PACKAGE}.{name}"):
            raise  # the module exists but one of its imports is missing: say so


def _builtin_names() -> list[str]:
    try:
        pkg = importlib.import_module(BUILTIN_PACKAGE)
    except ModuleNotFoundError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.ispkg)


def lookup(name: str) -> Callable[..., Any]:
    """The class or factory registered under ``name``."""
    if name not in _REGISTRY and "." not in name and "/" not in name:
        _import_builtin(name)
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        known = ", ".join(registered()) or "none"
        failed = "".join(f"\n  entry point {k} failed to load: {v}" for k, v in _FAILED_ENTRY_POINTS.items())
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}; registered: {known}. Import the module that defines it "
            f"(e.g. `import my_envs`, whose classes use @agentrl.environment({name!r})) or pip install "
            f"the package that provides it (it registers through the {ENTRY_POINT_GROUP!r} entry-point "
            f"group: [project.entry-points.{ENTRY_POINT_GROUP!r}] {name} = \"my_envs:MyEnv\").{failed}"
        )
    return _REGISTRY[name]


def make(name: str, **config: Any) -> Any:
    """Build the environment registered under ``name`` with ``config`` as keyword arguments."""
    return lookup(name)(**config)


def registered() -> list[str]:
    """Every registered name: decorated, installed through entry points, and built in."""
    for builtin in _builtin_names():
        try:
            _import_builtin(builtin)
        except Exception:
            log.warning("built-in environment package %s.%s failed to import", BUILTIN_PACKAGE, builtin,
                        exc_info=True)
    _load_entry_points()
    return sorted(_REGISTRY)


def failed_entry_points() -> dict[str, str]:
    """Entry points that did not load, with why (shown by ``agentrl envs list``)."""
    return dict(_FAILED_ENTRY_POINTS)
