"""Environment registry: ``@agentrl.environment("name")`` tags, ``agentrl.make`` builds.

Four ways a name becomes known, all ending in the same table:
- the decorator, when the module that defines the environment is imported;
- :func:`import_user_code`: a module or a file named in the config (``env.import``), imported before
  the name is looked up, so ``my_env.py`` next to the config is enough;
- the ``agentrl.environments`` entry-point group (``name = "module:ClassOrFactory"``) of any
  installed distribution, so ``pip install my-envs`` is enough; scanned again on every miss, so a
  package installed while the process runs is found too;
- the built-in ``environments`` package: ``environments.<name>`` is imported on a miss;
- an ecosystem adapter (:mod:`agentrl.env.adapters`) for a ``prefix:name`` such as
  ``reasoning_gym:basic_arithmetic``, resolved on a miss and registered under the full name.

Invariants: a name maps to exactly one object (registering a different object under a taken name
raises :class:`DuplicateEnvironmentError`; registering the same object again is a no-op, which
makes entry points that point at decorated classes harmless). An unknown name raises
:class:`UnknownEnvironmentError`, which lists what is registered, which entry points failed to
load and why, and what to import or install.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.errors import AgentrlError

if TYPE_CHECKING:
    from agentrl.env.base import Environment

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "agentrl.environments"
BUILTIN_PACKAGE = "environments"
_REGISTRY: dict[str, Callable[..., Any]] = {}
_FAILED_ENTRY_POINTS: dict[str, str] = {}  # "name = value" -> why it did not load
_LOADED_ENTRY_POINTS: set[tuple[str, str]] = set()
T = TypeVar("T")


class UnknownEnvironmentError(AgentrlError, KeyError):
    """No environment is registered under the name asked for."""

    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateEnvironmentError(AgentrlError, ValueError):
    """A second, different object tried to register under a taken name."""


def _where(obj: Callable[..., Any]) -> str:
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


def import_user_code(spec: str) -> ModuleType:
    """Import ``spec``, a module name (``my_envs``, ``pkg.tasks``) or a Python file (``my_env.py``,
    ``./envs/shop.py``), so that what it registers becomes known. A file is imported under its stem
    with its folder on ``sys.path`` (so its own imports of neighbouring modules work)."""
    spec = spec.strip()
    if not spec:
        raise ValueError("an empty module or file to import")
    path = Path(spec).expanduser()
    if spec.endswith(".py") or "/" in spec or path.is_file():
        if not path.is_file():
            raise UserCodeError(f"cannot import {spec!r}: no such file ({path.resolve()})")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        name = path.stem
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path.resolve()):
            return sys.modules[name]
        found = importlib.util.spec_from_file_location(name, path.resolve())
        if found is None or found.loader is None:
            raise UserCodeError(f"cannot import {spec!r}: not a Python file")
        module = importlib.util.module_from_spec(found)
        sys.modules[name] = module
        try:
            found.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise UserCodeError(f"importing {path} raised {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name and spec.startswith(e.name):
            raise UserCodeError(f"cannot import {spec!r}: no module named {e.name!r} "
                                f"on the Python path (sys.path[0] is {sys.path[0]!r}); "
                                f"give a file path instead, e.g. ./{spec}.py") from e
        raise UserCodeError(f"importing {spec!r} failed: {e}") from e
    except Exception as e:
        raise UserCodeError(f"importing {spec!r} raised {type(e).__name__}: {e}") from e


class UserCodeError(AgentrlError, ImportError):
    """A module or file named to import (``env.import``) could not be imported; the message says why."""


def lookup(name: str) -> Callable[..., Any]:
    """The class or factory registered under ``name``."""
    if name not in _REGISTRY and "." not in name and "/" not in name:
        _import_builtin(name)
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY and ":" in name:
        from agentrl.env import adapters

        if adapters.ecosystem_of(name) is not None:
            try:
                obj = adapters.resolve(name)
            except adapters.AdapterError as e:
                raise UnknownEnvironmentError(f"unknown environment {name!r}: {e}") from None
            environment(name)(obj)
    if name not in _REGISTRY:
        from agentrl.env import adapters

        known = ", ".join(registered()) or "none"
        failed = "".join(f"\n  entry point {k} failed to load: {v}" for k, v in _FAILED_ENTRY_POINTS.items())
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}; registered: {known}. To make it known, import the "
            f"module or file that defines it (whose class uses @agentrl.environment({name!r})): "
            "`--env.import=my_env.py` or `--env.import=my_package.envs` (in Python: `import "
            "my_envs`), or pip install the package that provides it (it registers through the "
            f"{ENTRY_POINT_GROUP!r} entry-point group: [project.entry-points.{ENTRY_POINT_GROUP!r}] "
            f"{name} = \"my_envs:MyEnv\"), or name an ecosystem's environment as prefix:name "
            f"(e.g. reasoning_gym:basic_arithmetic); {adapters.describe()}.{failed}"
        )
    return _REGISTRY[name]


def make(name: str, **config: Any) -> Environment:
    """Build the environment registered under ``name`` with ``config`` as keyword arguments."""
    return lookup(name)(**config)


def sandbox_image_of(name: str, config: dict[str, Any] | None = None) -> str | None:
    """The sandbox image(s) a run of ``name`` with ``config`` needs (several comma-separated; None:
    none): the environment's ``sandbox_image``, unless it says per config (a classmethod
    ``sandbox_image_of(config)``, as a mix of environments does)."""
    obj = lookup(name)
    per_config = getattr(obj, "sandbox_image_of", None)
    if callable(per_config):
        return per_config(dict(config or {}))
    return getattr(obj, "sandbox_image", None)


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
