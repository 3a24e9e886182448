"""The import graph of ``agentrl/``: no cycles between modules or between packages, the router's capture
core imports no dialect, and what the learner's loop module imports.

Every module under ``agentrl/`` is parsed with ``ast``. An edge is an ``import`` or ``from ... import``
statement, absolute or relative, at module level or inside a function or method (a lazy import runs
as soon as its function does, so it is a dependency like any other). Imports under
``if TYPE_CHECKING:`` are not edges: they never run, they only name types. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, to the module a lazy package export names
(``agentrl._lazy.lazy``, read from the package's ``__init__``) when ``name`` is one, else to ``pkg``.
Importing a module also runs its parents' ``__init__``; those implicit imports are not edges (every
module would otherwise depend on ``agentrl/__init__.py``, which only re-exports the environment API).

A package is a part of the architecture: ``agentrl.<part>`` (``agentrl.router.dialects`` belongs to
the router); a top-level module (``agentrl.errors``) is its own.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path

from tests.test_layout import _type_checking, cycles, reachable

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "agentrl"

# Cycles known and allowed, each named with the edge that closes it: none. A new cycle fails the test;
# so would one of these going away (then delete it here).
KNOWN_MODULE_CYCLES: list[list[str]] = []
KNOWN_PACKAGE_CYCLES: list[list[str]] = []

# The router's wire protocols (one module each, and what only one of them uses).
DIALECTS = "agentrl.router.dialects"
# The router modules above the capture core: the app that composes core and dialects, and the HTTP
# helpers every route shares. Every other ``agentrl.router`` module is the capture core.
ROUTER_APP = {"agentrl.router", "agentrl.router.server", "agentrl.router.http"}
# Modules that exist for one kind of policy only (LoRA adapters). The learner's loop imports none of
# them: the policy set (``agentrl.learner.policies``) activates adapters and merges them for
# publishing (issue #35). Listed so the test says what holds now and fails when it changes.
POLICY_SPECIFIC = {"agentrl.learner.lora", "agentrl.weights.adapters"}
LOOP_IMPORTS_TODAY: set[str] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def lazy_exports(package: str) -> dict[str, str]:
    """The names a package's ``__init__`` exports lazily (``lazy(__name__, {module: [names]})``) -> their
    module."""
    path = modules().get(package)
    if path is None or path.name != "__init__.py":
        return {}
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy" and len(node.args) == 2:
            table = node.args[1]
            if isinstance(table, ast.Dict):
                for key, names in zip(table.keys, table.values, strict=True):
                    if isinstance(key, ast.Constant) and isinstance(names, (ast.List, ast.Tuple)):
                        out.update({n.value: key.value for n in names.elts if isinstance(n, ast.Constant)})
    return out


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """A relative import's absolute module name."""
    base = module.split(".")
    base = base[: len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str) -> set[str]:
    """The ``agentrl`` modules ``module`` imports (see the module docstring for what counts)."""
    path = modules()[module]
    known = modules()
    tree = ast.parse(path.read_text())
    # what runs only under a type checker: the body of every ``if TYPE_CHECKING:`` (its else runs)
    hidden = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If) and _type_checking(t)
              for b in t.body for n in ast.walk(b)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            src = _absolute(module, path.name == "__init__.py", node.level, node.module) if node.level \
                else node.module or ""
            for a in node.names:
                full = f"{src}.{a.name}"
                out.add(full if full in known else lazy_exports(src).get(a.name, src))
    return {m for m in out if m in known and m != module}


@cache
def module_graph() -> dict[str, frozenset[str]]:
    return {m: frozenset(imports_of(m)) for m in modules()}


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for src, deps in module_graph().items():
        graph.setdefault(package_of(src), set()).update(
            d for d in map(package_of, deps) if d not in (package_of(src), "agentrl"))
    return graph


def sorted_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """:func:`tests.test_layout.cycles` (Tarjan), the components in a fixed order."""
    return sorted(cycles({k: set(v) for k, v in graph.items()}))


def test_the_graph_reads_lazy_exports_and_relative_imports() -> None:
    graph = module_graph()
    assert lazy_exports("agentrl.router")["Router"] == "agentrl.router.core"
    # `from agentrl.router import Router`, lazily
    assert "agentrl.router.core" in graph["agentrl.serve.build"]
    assert _absolute("agentrl.router.dialects.chat", False, 1, "http") == "agentrl.router.dialects.http"
    assert _absolute("agentrl.router.dialects", True, 2, "core") == "agentrl.router.core"
    assert sorted_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]


def test_no_module_imports_itself_back() -> None:
    assert sorted_cycles(module_graph()) == KNOWN_MODULE_CYCLES


def test_no_package_imports_itself_back() -> None:
    graph = package_graph()
    assert graph["agentrl.router"] and graph["agentrl.learner"], "the graph was built"
    assert sorted_cycles(graph) == KNOWN_PACKAGE_CYCLES


def test_the_capture_core_imports_no_dialect() -> None:
    graph = module_graph()
    core = [m for m in graph if m.startswith("agentrl.router.") and m not in ROUTER_APP
            and not m.startswith(DIALECTS)]
    assert "agentrl.router.core" in core and "agentrl.router.sessions" in core
    reached = {m: sorted(d for d in reachable(graph, m) if d.startswith(DIALECTS)) for m in core}
    assert {m: d for m, d in reached.items() if d} == {}


def test_the_engine_pool_imports_neither_the_router_nor_the_weight_sync() -> None:
    reached = reachable(module_graph(), "agentrl.engines.pool")
    assert not {m for m in reached if m.startswith(("agentrl.router", "agentrl.weights"))}, reached


def test_the_learners_loop_imports_no_policy_specific_module() -> None:
    direct = module_graph()["agentrl.learner.trainer"] & POLICY_SPECIFIC
    assert direct == LOOP_IMPORTS_TODAY
