"""The built-in models the project ships: made by their current recipes, used instead of a build, and
rebuilt here only when asked (or when a recipe changed without a re-ship)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from agentrl import models
from agentrl.models import shipped

SHIPPED_NAMES = ["smollm2-tools", "tiny", "tiny-agent", "tiny-arith", "tiny-moe", "tiny-tools"]


def _digest(folder: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()
    }


def test_every_shipped_model_carries_the_stamp_of_its_current_recipe(tmp_path, monkeypatch):
    # tiny-agent's recipe names its base's build: resolve that from the shipped files only
    monkeypatch.setenv("AGENTRL_HOME", str(tmp_path))
    assert shipped.shipped_names() == SHIPPED_NAMES
    for name in SHIPPED_NAMES:
        file, wanted = models.recipe_stamp(name)
        stamp = shipped.read_stamp(shipped.SHIPPED / name, file)
        stale = {k: (stamp.get(k), v) for k, v in wanted.items() if stamp.get(k) != v}
        assert not stale, (f"the shipped {name} was made by another recipe (shipped, now): {stale}; "
                           f"rebuild and re-ship it: agentrl model build --rebuild --ship {name}")


def test_a_shipped_model_is_installed_into_an_empty_cache_without_building(tmp_path, monkeypatch):
    import agentrl.models.warmstart as warmstart

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built instead of installed from the shipped files")

    monkeypatch.setattr(warmstart, "warm_start", no_build)
    monkeypatch.setenv("AGENTRL_HOME", str(tmp_path))
    out = Path(models.resolve_model("tiny-tools"))
    assert out == tmp_path / "models" / "tiny-tools"
    assert _digest(out) == _digest(shipped.SHIPPED / "tiny-tools")
    assert shipped.is_current(out, models.recipe_stamp("tiny-tools"))
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == ["tiny-tools"]


def test_a_shipped_model_made_by_another_recipe_is_not_used_and_the_model_is_built_here(
        tmp_path, monkeypatch, caplog):
    real = shipped.SHIPPED / "tiny"
    fake = tmp_path / "shipped"
    shutil.copytree(real, fake / "tiny")
    stamp = json.loads((fake / "tiny" / "agentrl_recipe.json").read_text())
    (fake / "tiny" / "agentrl_recipe.json").write_text(json.dumps({**stamp, "build_version": "0"}))
    (fake / "tiny" / "model.safetensors").write_bytes(b"not these weights")
    monkeypatch.setattr(shipped, "SHIPPED", fake)
    monkeypatch.setenv("AGENTRL_HOME", str(tmp_path / "home"))
    out = Path(models.resolve_model("tiny"))
    assert "made by another recipe" in caplog.text
    assert _digest(out) == _digest(real)  # built here by the recipe (deterministic), not copied
    assert shipped.is_current(out, models.recipe_stamp("tiny"))


def test_rebuild_builds_from_the_recipe_here_even_when_the_cache_holds_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_HOME", str(tmp_path))
    out = Path(models.resolve_model("tiny"))
    installed = (out / "model.safetensors").stat().st_mtime_ns
    assert Path(models.resolve_model("tiny")) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == installed  # found current: left alone
    assert Path(models.resolve_model("tiny", rebuild=True)) == out
    assert (out / "model.safetensors").stat().st_mtime_ns != installed  # built again
    assert _digest(out) == _digest(shipped.SHIPPED / "tiny")  # and the recipe is deterministic


def test_a_lora_warm_start_ships_an_adapter_whose_merge_gives_the_built_weights(tmp_path):
    from safetensors.torch import load_file

    from agentrl.models.tiny import build_tiny_model
    from agentrl.models.warmstart import fine_tune, merge_adapter, tool_use_warm_start

    assert fine_tune  # the loop both warm-starts share
    base = build_tiny_model(tmp_path / "base")
    built = tmp_path / "built"
    shutil.copytree(base, built)
    figures = tool_use_warm_start(built, steps=3, batch_size=2, lr=1e-2, top_layers=1, seed=0,
                                  lora={"rank": 4, "alpha": 8}, adapter_dir=built / "adapter")
    assert figures["loss"] == figures["loss"]  # a number, not NaN
    adapter = load_file(built / "adapter" / "adapter_model.safetensors")
    assert adapter and all(".layers.1." in k for k in adapter)  # only the top layer has an adapter
    merged = tmp_path / "merged"
    shutil.copytree(base, merged)
    merge_adapter(merged, built / "adapter")
    a, b, c = (load_file(f / "model.safetensors") for f in (built, merged, base))
    assert a.keys() == b.keys() == c.keys()
    changed = [k for k in a if not (a[k] == c[k]).all()]
    assert changed and all(".layers.1." in k for k in changed)  # the warm-start changed the top layer only
    assert all((a[k] == b[k]).all() for k in a)  # merging the shipped adapter gives the same weights


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-agent"])
def test_model_build_prints_the_installed_folder(tmp_path, name):
    import os
    import subprocess
    import sys

    env = {**os.environ, "AGENTRL_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "model", "build", name], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    folder = Path(out.stdout.strip())
    assert folder == tmp_path / "models" / name and shipped.is_current(folder, models.recipe_stamp(name))
