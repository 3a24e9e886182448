"""Chaos: kill -9 the engine, the learner and serve at random moments of a real run, then audit.

A real run on this machine: ``agentrl serve`` (its vLLM engine, Docker sandboxes, the buffer)
and ``agentrl learn --resume`` as two processes, supervised by this script as systemd or
Kubernetes would (``tests/chaos_harness.py`` says how, and what the audit checks). Each trial
kills one process once the run is steady; ``--learner-kills N`` also kills the restarted learner N
more times while the run recovers from each kill, as the CI test does (``tests/test_chaos.py``).

Final JSON line: trials, recoveries, max_recovery_s (per kind), lost_samples, double_trained,
skipped_tasks, orphans, and the buffer's counts.

    .venv/bin/python benchmarks/chaos.py --trials 2            # 2 of each kind, about 15 minutes
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.chaos_harness import Run, Trials, play, report  # noqa: E402 - after the repository is on sys.path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=2, help="kills of each kind")
    p.add_argument("--kinds", default="engine,learner,serve")
    p.add_argument("--learner-kills", type=int, default=0, help="learner kills during each kill's recovery")
    p.add_argument("--model", default="tiny-tools")
    p.add_argument("--env", default="arithmetic")
    p.add_argument("--run-dir", default="runs/chaos")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recovery-timeout-s", type=float, default=600.0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    base = Path(args.run_dir).resolve()
    subprocess.run(["rm", "-rf", str(base)], check=True)
    (base / "run").mkdir(parents=True)
    run = Run(base / "run", args.model, args.env)
    kinds = [k for k in args.kinds.split(",") for _ in range(args.trials)]
    rng.shuffle(kinds)
    trials = Trials()
    t0 = time.monotonic()
    try:
        run.start_serve()
        run.start_learner()
        if not run.wait_step_after(0, args.recovery_timeout_s):
            raise SystemExit(f"the run made no first step; see {base}/serve.out and {base}/learn.out")
        print(f"[{time.monotonic() - t0:6.0f}s] first learner step; {len(kinds)} rounds to come", flush=True)
        for kind in kinds:
            play(
                run,
                kind,
                rng,
                trials,
                learner_kills=args.learner_kills,
                timeout_s=args.recovery_timeout_s,
                t0=t0,
            )
    finally:
        result = report(run, trials, t0)
    print(json.dumps({"benchmark": "chaos", **result}), flush=True)


if __name__ == "__main__":
    main()
