"""The package structure holds: every module imports in a fresh interpreter, packages depend on each
other without cycles, and the two rules the architecture names (the router never imports the weight
sync; the built-in environments never import the model zoo).

Imports are read from the source (every ``import`` statement, at module level or inside a function,
except those under ``if TYPE_CHECKING:``), so a lazy import inside a function counts as a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agentrl", "environments")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path, module: str) -> set[str]:
    """The project modules ``path`` imports (absolute and relative), anywhere but under TYPE_CHECKING."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                is_pkg = path.name == "__init__.py"
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    known = modules()
    return {m for m in out if m in known and m != module}


def package_of(module: str) -> str:
    """A module's package: ``agentrl.router.core`` -> ``agentrl.router``; top-level modules
    (``agentrl.errors``) stand alone; every built-in environment is ``environments``."""
    parts = module.split(".")
    if parts[0] == "environments":
        return "environments"
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules().items():
        src = package_of(name)
        graph.setdefault(src, set())
        for dep in imports_of(path, name):
            dst = package_of(dep)
            if dst != src and dst != "agentrl":  # the package root only re-exports the environment API
                graph[src].add(dst)
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    names = sorted(m for m in modules() if not m.endswith("__main__"))  # a __main__ runs its command
    code = ("import importlib, sys\nbad = []\nfor m in sys.argv[1:]:\n    try:\n"
            "        importlib.import_module(m)\n    except Exception as e:\n"
            "        bad.append(f'{m}: {type(e).__name__}: {e}')\nprint('BAD', bad)")
    out = subprocess.run(
        [sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert "BAD []" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_packages_depend_on_each_other_without_cycles() -> None:
    graph = package_graph()
    assert graph["agentrl.router"], "the graph was built (the router imports something)"
    assert cycles(graph) == []


def test_the_router_does_not_import_the_weight_sync() -> None:
    graph = package_graph()
    assert "agentrl.weights" not in reachable(graph, "agentrl.router"), graph["agentrl.router"]


def test_the_environments_do_not_import_the_model_zoo() -> None:
    graph = package_graph()
    assert "agentrl.models" not in reachable(graph, "environments"), graph["environments"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
