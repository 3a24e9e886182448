"""``agentrl envs list | show NAME``: helpers for writing environments.

``agentrl.cli`` calls these; each returns an exit code and writes to ``out``. ``list`` names every
registered environment and what each installed ecosystem offers. ``show`` prints an example task
and the opening (messages, tools); it exits 1 with the ``error`` when the environment cannot list
its tasks or open an episode. ``agentrl envs try``, which plays an episode, is
:mod:`agentrl.rollout.tryout` (it plays the way the rollout does, and this package is below it).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

from agentrl.env.registry import failed_entry_points, lookup, make, registered

Write = Callable[[str], Any]


def _summary(obj: Callable[..., Any]) -> str:
    doc = obj.__doc__ or sys.modules[obj.__module__].__doc__ or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def list_envs(out: Write = sys.stdout.write, per_ecosystem: int = 0) -> int:
    """One line per registered environment; entry points that failed to load, with why; then what
    each installed ecosystem offers (``prefix:name``) and how to add the missing ones."""
    from agentrl.env import adapters

    for name in registered():
        if adapters.ecosystem_of(name) is None:
            out(f"{name:24s} {_summary(lookup(name))}\n")
    for ep, why in failed_entry_points().items():
        out(f"(failed) {ep}: {why}\n")
    for prefix, names in adapters.offered().items():
        shown = names[:per_ecosystem] if per_ecosystem > 0 else names
        out(f"\n[{prefix}] {len(names)} environment(s)\n")
        for name, about in shown:
            out(f"{name:24s} {about}\n")
        if len(shown) < len(names):
            out(f"... and {len(names) - len(shown)} more\n")
    out(f"\n{adapters.describe()}\n")
    return 0


def show_env(name: str, out: Write = sys.stdout.write, **config: Any) -> int:
    """The environment's description, an example task, and its opening (messages and tools). Exit code
    1, with the ``error`` shown, when its tasks or its reset raise: an environment that cannot open
    an episode cannot be trained on. An environment with a sandbox is reset without one: if that
    raises, or its opening is not a tool environment's prompt, the opening is shown as needing the
    sandbox (``opening``), not as an error."""
    env = make(name, **config)
    info: dict[str, Any] = {"name": name, "class": f"{type(env).__module__}.{type(env).__qualname__}",
                            "about": _summary(type(env)), "sandbox_image": env.sandbox_image}
    try:
        info["example_task"] = task = next(iter(env.tasks("test")))
        if info["sandbox_image"] and not hasattr(env, "prompt"):
            info["opening"] = "not shown: it needs the sandbox"
        else:
            opening = asyncio.run(env.reset(task))
            info.update(messages=opening.messages, tools=opening.tools)
    except Exception as e:
        why = f"{'reset' if 'example_task' in info else 'tasks'} raised {type(e).__name__}: {e}"
        if not (info["sandbox_image"] and "example_task" in info):
            info["error"] = why
            out(json.dumps(info, indent=2, default=str) + "\n")
            return 1
        info["opening"] = f"not shown: it needs the sandbox ({why})"
    out(json.dumps(info, indent=2, default=str) + "\n")
    return 0
