"""Two roles, two LoRA policies, one ``agentrl run``: does each role's policy learn its own part?

Runs ``agentrl run`` on the shipped ``arithmetic_relay`` environment (the ``first`` agent computes an
expression with the python tool in a Docker sandbox; the ``second`` multiplies the number it was
handed, with the same tool) with each role bound to its own named LoRA policy (rank ``--rank``, lr
1e-3 as ``benchmarks/learning.py --lora``): one engine holds both adapters, one learner trains them
in turn, each with its own optimizer, versions and buffer stream. ``agentrl run`` evaluates every
role on the same ``--tasks`` held-out tasks before the first step and after the last (each role
played by its own policy, as in training); the metric is each role's exact-answer success
(``info["role_success"]``), with a 95% Wilson interval. Progress lines are passed through.

Prints one JSON line at the end::

    {"roles": {"first": {"metric": ..., "before": x, "after": y, "before_ci95": [lo, hi],
               "after_ci95": [lo, hi], "intervals_apart": bool}, "second": {...}},
     "policies": 2, "steps_by_policy": {...}, "team_before": ..., "team_after": ..., "wall_minutes": m}

    python benchmarks/multi_agent.py [--steps 160] [--tasks 200] [--rank 8] [--run-dir runs/multi_agent]
                                     [-- extra agentrl run overrides]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from common import agentrl_run, free_port  # benchmarks/common.py

LORA_LR = 1e-3  # as benchmarks/learning.py --lora
ROLES = ("first", "second")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=160, help="learner steps, both policies together")
    p.add_argument("--tasks", type=int, default=200, help="held-out tasks evaluated before and after")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of each role's policy")
    p.add_argument("--run-dir", default="runs/multi_agent")
    p.add_argument("extra", nargs="*", help="more agentrl run overrides (after --)")
    args = p.parse_args()
    run_dir = Path(args.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.monotonic()
    cmd = [
        sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={run_dir}",
        f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
        # groups of 8: the recipe its figures were measured with (the quickstart's was 8 until 2026-12-07)
        "--serve.env.name=arithmetic_relay", "--serve.env.group_size=8", f"--eval.tasks={args.tasks}",
        f"--learn.steps={args.steps}",
        f"--learn.lora.rank={args.rank}", f"--learn.lr={LORA_LR}", "--learn.policy_wait_s=900",
        *(f"--serve.policies.{r}={{}}" for r in ROLES), *(f"--serve.env.roles.{r}.policy={r}" for r in ROLES),
        *args.extra,
    ]
    summary = agentrl_run(cmd, run_dir, t0)
    evals = {label: json.loads((run_dir / f"eval_{label}.json").read_text()) for label in ("before", "after")}
    roles = {}
    for role in ROLES:
        before, after = evals["before"]["by_role"][role], evals["after"]["by_role"][role]
        roles[role] = {
            "metric": "exact-answer success on held-out tasks (its own part, played by its own policy)",
            "before": round(before["success_rate"], 4), "after": round(after["success_rate"], 4),
            "before_ci95": [round(x, 4) for x in before["success_ci95"]],
            "after_ci95": [round(x, 4) for x in after["success_ci95"]],
            "intervals_apart": after["success_ci95"][0] > before["success_ci95"][1],
            "reward_before": round(before["reward_mean"], 4), "reward_after": round(after["reward_mean"], 4),
        }
    print(json.dumps({
        "benchmark": "multi_agent", "env": "arithmetic_relay", "roles": roles, "policies": len(ROLES),
        "steps_by_policy": summary.get("steps_by_policy", {}), "eval_tasks": args.tasks,
        "team_before": summary["success_before"], "team_after": summary["success_after"],
        "wall_minutes": round((time.monotonic() - t0) / 60, 2),
    }), flush=True)


if __name__ == "__main__":
    main()
