"""The docs build into a site with ``mkdocs build --strict`` (mkdocs.yml), as CI's test command checks.

Strict is the point: a link or an anchor between the pages that does not resolve, or a symbol the
reference pages name (``::: agentrl.ToolEnv``) that the code no longer has, fails the build. The site
is built once into a temporary folder (nothing is written into the repository), and the tests read it:
the Python API page documents everything ``agentrl`` exports, the config page every documented field
of each config it shows (the ``# comment`` ``agentrl config show`` prints), and search covers it all.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import agentrl
from agentrl.config import field_docs

ROOT = Path(__file__).resolve().parents[1]
DIRECTIVE = re.compile(r"^::: ([\w.]+)$", re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # no bytecode for docs/griffe_agentrl.py in the repository; no Material banner in the log
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def anchors(page: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', page.read_text()))


def directives(md: str) -> list[str]:
    return DIRECTIVE.findall((ROOT / "docs" / md).read_text())


def resolve(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_python_api_page_documents_everything_agentrl_exports(site: Path) -> None:
    ids = anchors(site / "api" / "index.html")
    missing = [name for name in agentrl.__all__ if f"agentrl.{name}" not in ids]
    assert not missing, f"add `::: agentrl.<name>` to docs/api.md for: {missing}"
    assert {
        "agentrl.ToolEnv.prompt",
        "agentrl.ToolEnv.reward",
        "agentrl.environment",
        "agentrl.scorer",
    } <= ids


def test_the_config_page_documents_every_field_of_the_configs_it_shows(site: Path) -> None:
    ids = anchors(site / "config" / "index.html")
    shown = {resolve(path): path for path in directives("config.md") if isinstance(resolve(path), type)}
    assert {"agentrl.config.RunConfig", "agentrl.config.ServeConfig", "agentrl.config.LearnConfig"} <= set(
        shown.values())
    missing = []
    for cls, path in shown.items():
        for name in field_docs(cls):
            # an inherited field is documented under the base class that declares it, when that is shown too
            homes = [
                shown[k] for k in cls.__mro__ if k in shown and name in vars(k).get("__annotations__", {})
            ]
            if not any(f"{home}.{name}" in ids for home in homes or [path]):
                missing.append(f"{path}.{name}")
    assert not missing, f"fields with documentation that the config page does not show: {missing}"


def test_a_field_comment_is_its_documentation_on_the_config_page(site: Path) -> None:
    page = (site / "config" / "index.html").read_text()
    comment = field_docs(agentrl.config.RunConfig)["restarts"]
    assert comment.startswith("relaunches in a row")
    assert comment in page


def test_a_sphinx_role_in_a_docstring_becomes_a_link_to_the_object(site: Path) -> None:
    # TaskListEnv's docstring names ":class:`ToolEnv`", which the same page documents
    page = (site / "api" / "index.html").read_text()
    assert ":class:" not in page
    assert re.search(r'<a class="autorefs '
                     r'autorefs-internal"[^>]*href="#agentrl\.ToolEnv"><code>ToolEnv</code>', page)


def test_search_indexes_every_page_and_the_reference(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text())
    pages = {doc["location"].split("#")[0] for doc in index["docs"]}
    guides = {f"{p.stem}/" for p in (ROOT / "docs").glob("*.md") if p.stem != "index"}
    assert guides | {""} <= pages
    assert any(doc["location"] == "api/#agentrl.ToolEnv" for doc in index["docs"])
