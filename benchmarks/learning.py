"""Does it learn? The quickstart (``agentrl run`` with its defaults) evaluated before and after.

Runs ``agentrl run`` exactly as the README's first command does (the embedded defaults: model,
environment, learner recipe), adding only a fresh run directory, free ports and the number of
held-out tasks. ``agentrl run`` evaluates the agent on that many held-out tasks of the
environment's ``test`` split through serve's router before the learner's first step and after its
last, at the training temperature, and writes the charts. Progress lines are passed through.
Prints one JSON line at the end with ``success_before``, ``success_after``, their 95% Wilson
intervals, ``wall_minutes`` (the whole ``agentrl run``: engine start, both evaluations, training)
and ``model``. Success is the environment's declared success where it declares one (reasoning-gym:
the exact answer, score 1), else a reward above 0 (``success_measure`` says which); beside it,
``partial_credit_before``/``_after`` is the share of episodes with any reward at all (for reasoning-gym
the right number anywhere in the reply: the measure these figures used before #41) and
``reward_before``/``_after`` the mean reward.

    python benchmarks/learning.py [--tasks 200] [--run-dir runs/learning] [--env NAME] [--model NAME]
                                  [--lora RANK] [--config FILE] [-- extra agentrl run overrides]

``--env`` and ``--model`` pass through as ``--serve.env.name`` and ``--serve.model`` (any registered or
ecosystem name, e.g. ``--env reasoning_gym:basic_arithmetic``; docs/environments.md names a recipe).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from common import agentrl_run, free_port  # benchmarks/common.py

# --lora: adapters move less per unit of lr than full weights (the usual 10x of the full recipe's)
LORA_LR = 1e-3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=200, help="held-out tasks evaluated before and after")
    p.add_argument("--run-dir", default="runs/learning")
    p.add_argument("--env", default="", help="the environment (--serve.env.name), "
                                             "e.g. reasoning_gym:basic_arithmetic")
    p.add_argument("--model", default="", help="the model (--serve.model), e.g. smollm2")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="train LoRA adapters of this rank (--learn.lora.rank) "
                        f"at lr {LORA_LR:g} instead of every weight")
    p.add_argument(
        "--config", default="", help="an agentrl run config file (e.g. examples/smollm2-lora.toml)"
    )
    p.add_argument("extra", nargs="*", help="more agentrl run overrides, e.g. --learn.steps=10 (after --)")
    args = p.parse_args()
    run_dir = Path(args.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={run_dir}",
        f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
        f"--eval.tasks={args.tasks}", *([f"--serve.env.name={args.env}"] if args.env else []),
        *([f"--serve.model={args.model}"] if args.model else []),
        *([f"--config={args.config}"] if args.config else []),
        *([f"--learn.lora.rank={args.lora}", f"--learn.lr={LORA_LR}"] if args.lora else []), *args.extra,
    ]
    summary = agentrl_run(cmd, run_dir, time.monotonic())
    config = (
        json.loads((run_dir / "serve_config.json").read_text())
        if (run_dir / "serve_config.json").exists()
        else {}
    )
    # serve's engines take adapters of the learner's rank
    result = {
        "benchmark": "learning", "model": config.get("model", "?"),
        "env": config.get("env", {}).get("name", "?"), "eval_tasks": summary["eval_tasks"],
        "learner_steps": summary["steps"], "success_before": summary["success_before"],
        "success_after": summary["success_after"],
        "gain": round(summary["success_after"] - summary["success_before"], 4),
        "success_before_ci95": summary["success_before_ci95"],
        "success_after_ci95": summary["success_after_ci95"], "reward_before": summary["reward_before"],
        "reward_after": summary["reward_after"], "wall_minutes": summary["wall_minutes"],
        "charts": summary.get("charts", ""), "load_avg": round(os.getloadavg()[0], 2),
        "lora_rank": config.get("engine", {}).get("lora_rank", 0),
    }
    result.update(partial_credit(run_dir))
    print(json.dumps(result), flush=True)


def partial_credit(run_dir: Path) -> dict[str, object]:
    """The share of evaluation episodes with any reward, before and after, and how success was judged
    (from ``agentrl run``'s ``eval_before.json`` and ``eval_after.json``)."""
    out: dict[str, object] = {}
    for label in ("before", "after"):
        ev = json.loads((run_dir / f"eval_{label}.json").read_text())
        credited = sum(e["error"] is None and e["terminated"] and e["reward"] > 0 for e in ev["episodes"])
        out[f"partial_credit_{label}"] = round(credited / max(1, ev["n"]), 4)
        out["success_measure"] = (
            "declared" if ev["declared"] == ev["n"] else "reward > success_reward" if not ev["declared"]
            else f"declared for {ev['declared']} of {ev['n']} episodes, else reward > success_reward"
        )
    return out


if __name__ == "__main__":
    main()
