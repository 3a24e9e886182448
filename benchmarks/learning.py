"""Does it learn? The quickstart (``agentrl run`` with its defaults) evaluated before and after.

Runs ``agentrl run`` exactly as the README's first command does (the embedded defaults: model,
environment, learner recipe), adding only a fresh run directory, free ports and the number of
held-out tasks. ``agentrl run`` evaluates the agent on that many held-out tasks of the
environment's ``test`` split through serve's router before the learner's first step and after its
last, at the training temperature, and writes the charts. Progress lines are passed through.
Prints one JSON line at the end with ``success_before``, ``success_after``, their 95% Wilson
intervals, ``wall_minutes`` (the whole ``agentrl run``: engine start, both evaluations, training)
and ``model``.

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
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
