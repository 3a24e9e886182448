"""Curriculum versus uniform task sampling: the same training run twice, on mixed-difficulty tasks.

Both runs are ``agentrl run`` with the README's embedded defaults (model, learner recipe) on
``arithmetic`` with ``digits`` (``--digits``, default 1,2,4,8: each task's operands have one of these
sizes, from trivial to beyond the small model's reach), the same seeds and the same held-out tasks,
and the same wall time: each trains for ``--minutes`` (default 5) whatever number of steps that
makes (``learn.steps = 0``, ``learn.max_minutes``; ``--minutes 0``: the defaults' 60 steps each
instead). They differ in one setting: ``serve.env.curriculum.enabled`` (docs/curriculum.md):
uniform plays the task stream in order, each task in one group; the curriculum replays tasks by
their pass rate so far and drops groups without reward spread (the rollout plays others instead),
so its steps take longer: at equal time it takes fewer.

Figures: held-out success before and after each run (exact answers, 95% Wilson intervals), and the
share of the run's finished groups whose rewards had no spread (all right or all wrong: nothing for
GRPO to learn from), from ``episodes.jsonl``. Prints progress, then one JSON line with
``success_curriculum``, ``success_uniform``, their ``_ci95``, the ``_before`` figures,
``zero_spread_curriculum``, ``zero_spread_uniform``, each run's ``steps_`` and ``train_minutes_``,
``minutes_each`` and ``wall_minutes`` (both runs, evaluations and start-ups included).

    python benchmarks/curriculum.py [--tasks 200] [--digits 1,2,4,8] [--minutes 5] [--out runs/curriculum]
                                    [-- extra agentrl run overrides, e.g. --learn.steps=10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from common import agentrl_run, free_port  # benchmarks/common.py


def zero_spread(run_dir: Path, group_size: int) -> dict[str, Any]:
    """The run's finished groups (every member in ``episodes.jsonl``), and the share whose rewards
    were all the same."""
    groups: dict[str, list[float]] = {}
    for line in (run_dir / "episodes.jsonl").read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            groups.setdefault(e["group_id"], []).append(float(e["reward"]))
    whole = [r for r in groups.values() if len(r) >= group_size]
    flat = sum(max(r) - min(r) <= 1e-9 for r in whole)
    return {"groups": len(whole), "zero_spread_groups": flat,
            "zero_spread": round(flat / len(whole), 4) if whole else 0.0}


def train_minutes(run_dir: Path) -> float:
    """Minutes from the learner's first step's pull to its last step's report (``learner.jsonl``)."""
    rows = [json.loads(line) for line in (run_dir / "learner.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        return 0.0
    first = rows[0]["time"] - rows[0].get("wait_s", 0) - rows[0].get("train_s", 0) - rows[0].get("sync_s", 0)
    return round((rows[-1]["time"] - first) / 60, 2)


def main() -> None:
    t0 = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=200, help="held-out tasks evaluated before and after")
    p.add_argument("--digits", default="1,2,4,8", help="operand sizes of the mixed-difficulty tasks")
    p.add_argument("--modes", default="uniform,curriculum")
    p.add_argument("--minutes", type=float, default=5.0,
                   help="training minutes of each run (learn.max_minutes, no step limit); 0: 60 steps each")
    p.add_argument("--out", default="runs/curriculum")
    p.add_argument("extra", nargs="*", help="more agentrl run overrides for both runs (after --)")
    args = p.parse_args()
    digits = [int(d) for d in args.digits.split(",")]
    out = Path(args.out)
    result: dict[str, Any] = {"benchmark": "curriculum", "env": "arithmetic", "digits": digits,
                              "eval_tasks": args.tasks, "minutes_each": args.minutes}
    timed = [f"--learn.max_minutes={args.minutes}", "--learn.steps=0"] if args.minutes else []
    for mode in args.modes.split(","):
        run_dir = out / mode
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={run_dir}",
               f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
               f"--eval.tasks={args.tasks}", "--serve.env.name=arithmetic",
               f"--serve.env.config.digits=[{','.join(map(str, digits))}]",
               f"--serve.env.curriculum.enabled={'true' if mode == 'curriculum' else 'false'}", *timed,
               *args.extra]
        print(f"[{mode}]", file=sys.stderr, flush=True)
        summary = agentrl_run(cmd, run_dir, t0)
        config = json.loads((run_dir / "serve_config.json").read_text())
        spread = zero_spread(run_dir, int(config["env"]["group_size"]))
        result.update({
            f"success_{mode}": summary["success_after"],
            f"success_{mode}_ci95": summary["success_after_ci95"],
            f"success_{mode}_before": summary["success_before"],
            f"success_{mode}_before_ci95": summary["success_before_ci95"],
            f"steps_{mode}": summary["steps"], f"run_minutes_{mode}": summary["wall_minutes"],
            f"train_minutes_{mode}": train_minutes(run_dir),
            f"zero_spread_{mode}": spread["zero_spread"], f"groups_{mode}": spread["groups"],
        })
        result["model"] = config.get("model", "?")
    if "success_curriculum_ci95" in result and "success_uniform_ci95" in result:
        (lo_c, hi_c), (lo_u, hi_u) = result["success_curriculum_ci95"], result["success_uniform_ci95"]
        result["intervals_apart"] = lo_c > hi_u or lo_u > hi_c
    result["load_avg"] = round(os.getloadavg()[0], 2)
    result["wall_minutes"] = round((time.monotonic() - t0) / 60, 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
