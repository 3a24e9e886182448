"""Ecosystem adapters: environments written for other frameworks, run unchanged by name.

``reasoning_gym:basic_arithmetic``, ``textarena:TicTacToe-v0``, ``openenv:<env>``,
``verifiers:<taskset module>``, ``harbor:<task or dataset folder>``: the registry hands a name with
a known prefix to :func:`resolve`, which imports that ecosystem's adapter module (one module per
ecosystem beside this one) and asks it for the environment class. The class is then registered
under the full name like any other environment.

Invariants: importing this package imports no ecosystem and no adapter module (``agentrl --help``
and ``agentrl envs list`` without ecosystems stay fast); :func:`installed` only looks packages up.
An adapter's environment keeps the ecosystem's own prompts, tools, parsers and rewards; what it adds
is the translation onto :class:`~agentrl.env.base.Environment` (or
:class:`~agentrl.env.base.PlayingEnv`, when the ecosystem's code drives the model calls itself).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.errors import AgentrlError

if TYPE_CHECKING:
    from types import ModuleType

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ecosystem:
    prefix: str  # the name's prefix, before ":"
    adapter: str  # the adapter module
    package: str  # the import name that says the ecosystem is installed ("" : nothing to install)
    extra: str  # how to install it
    example: str  # a name to try

    def is_installed(self) -> bool:
        if not self.package:
            return True
        if importlib.util.find_spec(self.package) is not None:
            return True
        probe = getattr(self._module_if_cheap(), "available", None)
        return bool(probe and probe())

    def _module_if_cheap(self) -> ModuleType | None:
        # verifiers runs in its own interpreter (it pins openai<3); its adapter module imports
        # nothing heavy and says whether that interpreter is there.
        if self.prefix != "verifiers":
            return None
        try:
            return importlib.import_module(self.adapter)
        except ImportError:
            return None


ECOSYSTEMS: dict[str, Ecosystem] = {
    e.prefix: e
    for e in (
        Ecosystem(
            "reasoning_gym",
            "agentrl.env.adapters.reasoning_gym",
            "reasoning_gym",
            "pip install 'agentrl[reasoning-gym]'",
            "reasoning_gym:basic_arithmetic",
        ),
        Ecosystem(
            "textarena",
            "agentrl.env.adapters.textarena",
            "textarena",
            "pip install 'agentrl[textarena]'",
            "textarena:TicTacToe-v0",
        ),
        Ecosystem(
            "openenv",
            "agentrl.env.adapters.openenv",
            "openenv",
            "pip install 'agentrl[openenv]'",
            "openenv:echo",
        ),
        Ecosystem(
            "verifiers",
            "agentrl.env.adapters.verifiers",
            "verifiers",
            "pip install 'agentrl[verifiers]' (its own venv: see docs/environments.md)",
            "verifiers:vf_arith",
        ),
        Ecosystem(
            "harbor",
            "agentrl.env.adapters.harbor",
            "",
            "nothing (task folders are read directly)",
            "harbor:tasks/harbor/hello-file",
        ),
    )
}
ALIASES = {"reasoning-gym": "reasoning_gym", "rg": "reasoning_gym", "ta": "textarena", "vf": "verifiers"}


class AdapterError(AgentrlError, KeyError):
    """A ``prefix:name`` could not be resolved: the ecosystem is missing or has no such environment."""

    def __str__(self) -> str:
        return str(self.args[0])


def ecosystem_of(name: str) -> Ecosystem | None:
    """The ecosystem a ``prefix:rest`` name belongs to (None: not an ecosystem name)."""
    prefix, sep, _ = name.partition(":")
    if not sep:
        return None
    return ECOSYSTEMS.get(ALIASES.get(prefix, prefix))


def installed() -> list[str]:
    return [p for p, e in ECOSYSTEMS.items() if e.is_installed()]


def describe() -> str:
    """One sentence on which ecosystems are installed and how to add the others."""
    have = installed()
    missing = [f"{p} ({e.extra})" for p, e in ECOSYSTEMS.items() if p not in have]
    text = f"ecosystems installed: {', '.join(f'{p}:' for p in have) or 'none'}"
    if missing:
        text += f"; to add one: {'; '.join(missing)}"
    return text


def resolve(name: str) -> Callable[..., Any]:
    """The environment class (or factory) for an ecosystem name; raises :class:`AdapterError`."""
    eco = ecosystem_of(name)
    if eco is None:
        raise AdapterError(f"{name!r} names no known ecosystem; {describe()}")
    rest = name.partition(":")[2]
    if not eco.is_installed():
        raise AdapterError(f"{name!r} needs the {eco.prefix} ecosystem, which is not installed: {eco.extra}. "
                           f"{describe()}")
    module = importlib.import_module(eco.adapter)
    return module.environment_class(rest)


def offered(limit: int = 0) -> dict[str, list[tuple[str, str]]]:
    """Per installed ecosystem, the names it offers with a one-line summary (``agentrl envs list``).
    ``limit`` > 0 keeps that many per ecosystem. An adapter that fails to list says why."""
    out: dict[str, list[tuple[str, str]]] = {}
    for prefix in installed():
        try:
            names = importlib.import_module(ECOSYSTEMS[prefix].adapter).offered()
        except Exception as e:  # one broken ecosystem must not hide the others
            names = [(f"{prefix}:?", f"(could not list: {type(e).__name__}: {e})")]
        out[prefix] = names[:limit] if limit > 0 else names
    return out
