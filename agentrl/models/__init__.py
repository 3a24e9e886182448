"""Model folders: the built-in tiny model and where models are cached."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Where agentrl caches models and other build products (``$AGENTRL_HOME``)."""
    return Path(os.environ.get("AGENTRL_HOME", Path.home() / ".cache" / "agentrl"))


def resolve_model(name: str) -> str:
    """Turn a model name from config into something transformers/vLLM load.

    ``"tiny"`` builds (once) and returns the project's tiny model, ``"tiny-tools"`` the same after a
    short tool-call warm-start, ``"tiny-arith"`` after a longer one that also teaches it to copy
    numbers, ``"tiny-agent"`` (the quickstart's) that one after a short mixed warm-start in which
    half the transcripts answer without the tool, ``"smollm2"`` converts SmolLM2-135M-Instruct offline from its PyPI
    wheel; a local folder is returned as is; anything else is passed through as a hub name.
    """
    if name == "tiny":
        from agentrl.models.tiny import build_tiny_model

        return str(build_tiny_model(home() / "models" / "tiny"))
    if name == "tiny-tools":
        return str(build_tiny_tools_model(home() / "models" / "tiny-tools"))
    if name == "tiny-arith":
        # The same model warm-started to copy numbers too: about half its sampled arithmetic episodes
        # succeed, so RL has something to sharpen (docs/learner.md). About 10 minutes on 2 cores.
        return str(build_tiny_tools_model(home() / "models" / "tiny-arith", steps=300, copy_steps=2000))
    if name == "tiny-agent":
        return str(build_tiny_agent_model(home() / "models" / "tiny-agent"))
    if name in ("smollm2", "smollm2-135m"):
        from agentrl.models.smollm2 import build_smollm2

        return str(build_smollm2(home() / "models" / "smollm2-135m"))
    return name


def build_tiny_tools_model(out: Path, steps: int = 100, copy_steps: int = 0) -> Path:
    """The tiny model after a supervised warm-start on the tool-call format (built once)."""
    import json
    import shutil

    from agentrl.models.tiny import build_tiny_model

    stamp = out / "agentrl_warmstart.json"
    done = json.loads(stamp.read_text()) if stamp.exists() else {}
    if done.get("steps") == steps and done.get("copy_steps", 0) == copy_steps:
        return out
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tmp, overwrite=True)
    from agentrl.models.warmstart import warm_start

    result = warm_start(tmp, steps=steps, copy_steps=copy_steps)
    (tmp / "agentrl_warmstart.json").write_text(json.dumps({"steps": steps, "copy_steps": copy_steps, **result}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# the tiny-agent recipe: tiny-arith, then this many whole-transcript steps, half of them answering
# without the tool (docs/learner.md)
AGENT_RECIPE = {"base": "tiny-arith", "steps": 150, "lr": 1e-3, "direct_frac": 0.5, "seed": 7}


def build_tiny_agent_model(out: Path) -> Path:
    """The quickstart's model (built once): ``tiny-arith`` plus a short warm-start on transcripts of
    which half answer at once without the tool. A two-layer model cannot do the arithmetic itself,
    so when it answers directly it is nearly always wrong, and when it calls the tool it is right
    about half the time: a choice that RL learns within minutes, on top of a skill it cannot."""
    import json
    import logging
    import shutil

    stamp = out / "agentrl_warmstart.json"
    done = json.loads(stamp.read_text()) if stamp.exists() else {}
    if done.get("recipe") == AGENT_RECIPE:
        return out
    base = resolve_model(AGENT_RECIPE["base"])
    logging.getLogger(__name__).info("building %s from %s", out, base)
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    from agentrl.models.warmstart import warm_start

    result = warm_start(tmp, steps=AGENT_RECIPE["steps"], lr=AGENT_RECIPE["lr"],
                        direct_frac=AGENT_RECIPE["direct_frac"], seed=AGENT_RECIPE["seed"])
    (tmp / "agentrl_warmstart.json").write_text(json.dumps({"recipe": AGENT_RECIPE, **result}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
