"""Every setting the docs name resolves in a config tree, and ``agentrl config show`` documents each field.

The docs name settings by their full dotted path (``buffer.lease_s``, ``serve.env.name``,
``learn.loss.clip_low``), in backticks or as ``--a.b=value`` on a command line; a path counts as a
setting when its first part is a section of a tree (``buffer``, ``loss``, ``serve``, ...). Each must
resolve in ``ServeConfig``, ``LearnConfig`` or ``RunConfig`` (any variant of a tagged union).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from agentrl import config as C

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "deploy" / "README.md"]
TREES = (C.ServeConfig, C.LearnConfig, C.RunConfig)


def sections() -> set[str]:
    """Names of the trees' sections (fields that are dataclasses or tagged unions), at any depth."""
    out: set[str] = set()

    def walk(cls: type) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            kinds = C.union_kinds(tp)
            if kinds is not None:
                out.add(f.name)
                for variant in kinds.values():
                    walk(variant)
            elif dataclasses.is_dataclass(tp):
                out.add(f.name)
                walk(tp)

    for tree in TREES:
        walk(tree)
    return out


BACKTICKED = re.compile(r"`(?:--)?([a-z_]+(?:\.[a-z_]+)+)(?:\s*=[^`]*)?`")
ON_A_COMMAND_LINE = re.compile(r"--([a-z_]+(?:\.[a-z_]+)+)=")
FILE_SUFFIXES = {"toml", "yaml", "yml", "md", "json", "jsonl", "log", "py", "txt", "png"}


def named_settings() -> list[tuple[str, str]]:
    """(doc, dotted setting) for every setting-looking path the docs name."""
    known = sections()
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for pattern in (BACKTICKED, ON_A_COMMAND_LINE):
            for m in pattern.finditer(text):
                name = m.group(1)
                if name.split(".")[0] in known and name.rsplit(".", 1)[-1] not in FILE_SUFFIXES:
                    out.append((doc.relative_to(ROOT).as_posix(), name))
    return sorted(set(out))


def resolves(name: str) -> bool:
    return any(C.resolve(tree, name) for tree in TREES)


def test_the_docs_name_many_settings_by_their_full_path() -> None:
    names = {n for _, n in named_settings()}
    assert len(names) > 60, sorted(names)
    for needed in ("buffer.stale_policy", "buffer.lease_s", "buffer.partial_groups", "sandbox.exec_timeout_s",
                   "sandbox.max_reuses", "learn.loss.clip_low", "learn.loss.mismatch_band"):
        assert any(n == needed or n.endswith("." + needed) for n in names), needed


@pytest.mark.parametrize(("doc", "name"), named_settings(), ids=lambda x: x)
def test_every_setting_the_docs_name_resolves_in_a_config_tree(doc: str, name: str) -> None:
    assert resolves(name), f"{doc} names `{name}`, which no config tree has"


def test_the_knobs_that_were_unreachable_are_settings_now() -> None:
    for name in ("buffer.stale_policy", "buffer.lease_s", "buffer.partial_groups", "sandbox.exec_timeout_s",
                 "sandbox.max_reuses"):
        assert C.resolve(C.ServeConfig, name), name
    for name in ("loss.clip_low", "loss.clip_high", "loss.mis_low", "loss.mis_high", "loss.level", "loss.agg",
                 "loss.mismatch_band", "loss.tis_cap", "loss.correction"):
        assert C.resolve(C.LearnConfig, name), name
    cfg = C.load(
        C.LearnConfig, None, ["--loss.kind=ppo", "--loss.clip_high=0.28", "--loss.mismatch_band=[0.5, 2.0]"]
    )
    assert cfg.loss.kind == "ppo" and cfg.loss.clip_high == 0.28 and cfg.loss.mismatch_band == (0.5, 2.0)
    serve = C.load(C.ServeConfig, None, ["--buffer.lease_s=30", "--sandbox.max_reuses=0"])
    assert serve.buffer.lease_s == 30.0 and serve.sandbox.max_reuses == 0


def test_an_unknown_kind_of_a_tagged_union_names_the_choices() -> None:
    with pytest.raises(C.ConfigError, match=r"loss\.kind.*'decoupled_ppo'.*'pg'.*'ppo'"):
        C.load(C.LearnConfig, None, ["--loss.kind=ppo2"])
    with pytest.raises(C.ConfigError, match=r"loss\.clip_low"):  # pg has no clip
        C.load(C.LearnConfig, None, ["--loss.kind=pg", "--loss.clip_low=0.1"])


def test_a_filled_in_field_is_refused_as_a_setting_with_where_it_comes_from() -> None:
    with pytest.raises(C.ConfigError, match=r"buffer\.group_size .*env\.group_size"):
        C.load(C.ServeConfig, None, ["--buffer.group_size=4"])


def test_config_show_serve_prints_each_field_with_its_documentation() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "config", "show", "serve"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    settings = [i for i, line in enumerate(lines) if re.match(r"^[a-z_]+ = ", line)]
    assert len(settings) > 60
    undocumented = [
        lines[i] for i in settings if not lines[i - 1].startswith("# ") and not lines[i].startswith("kind =")
    ]
    assert not undocumented, undocumented
    assert "# Seconds a served batch" in out.stdout or "# A served batch not acknowledged" in out.stdout
