"""Chaos: kill -9 the engine, serve and the learner, and stall the engine, at random moments of a
real run; then audit every sample by id.

A real run on this machine: ``agentrl serve`` (its vLLM engine, Docker sandboxes, the buffer)
and ``agentrl learn --resume`` as two processes, supervised by this script as systemd or
Kubernetes would (``tests/chaos_harness.py`` says how, and what the audit checks). It plays the
CI test's rounds (``tests/test_chaos.py``): each a stall of the engine (SIGSTOP of its engine
core), then serve and the engine killed while they come back, then the learner: ``--rounds`` of
them, four trials each, the same number of every kind.

Final JSON line: trials, trials_by_kind, recoveries, max_recovery_s (per kind), lost_samples,
double_trained, skipped_tasks, orphans, audited_ids, unaccounted, and the buffer's counts.

    .venv/bin/python benchmarks/chaos.py              # 5 rounds: 20 trials, 5 of each kind
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

from tests.chaos_harness import ROUNDS, Run, Trials, play, report  # noqa: E402 - after the repository is on sys.path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds of one fault of each kind")
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
    rounds = [ROUNDS[i % len(ROUNDS)] for i in range(args.rounds)]
    trials = Trials()
    t0 = time.monotonic()
    try:
        run.start_serve()
        run.start_learner()
        if not run.wait_step_after(0, args.recovery_timeout_s):
            raise SystemExit(f"the run made no first step; see {base}/serve.out and {base}/learn.out")
        print(f"[{time.monotonic() - t0:6.0f}s] first learner step; {len(rounds)} rounds to come", flush=True)
        for i, faults in enumerate(rounds):
            if not play(run, faults, rng, trials, timeout_s=args.recovery_timeout_s, t0=t0):
                # the run is broken: the rounds left would each wait out their timeouts for nothing
                left = len(rounds) - i - 1
                print(f"[{time.monotonic() - t0:6.0f}s] round {i + 1} did not recover; the {left} round(s) "
                      "left are not played", flush=True)
                break
    finally:
        result = report(run, trials, t0)
    print(json.dumps({"benchmark": "chaos", **result}), flush=True)


if __name__ == "__main__":
    main()
