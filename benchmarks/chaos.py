"""Chaos: kill -9 the engine, the learner and serve at random moments of a real run, then audit.

A real run on this machine: ``agentrl serve`` (its vLLM engine, Docker sandboxes, the buffer)
and ``agentrl learn --resume`` as two processes. This script is their process supervisor (what
systemd or Kubernetes is in production): after each kill it restarts the process it killed, as
such a supervisor would; the engine is relaunched by serve itself. A trial counts as recovered
when the learner has finished a new step after the kill; its recovery time is from the kill to
that step.

The audit, once everything is stopped:

- ``identity``: the buffer, recovered from its log, satisfies produced = consumed + dropped + pending;
- ``lost_samples``: samples of episodes whose put serve acknowledged (their ``episodes.jsonl``
  line) that the buffer does not have;
- ``double_trained``: sample ids acknowledged by the learner in more than one batch;
- ``skipped_tasks``: task indices below the rollout's cursor with no episode (tasks of groups still
  open in the frontier at the end are left out: they resume on the next start);
- ``orphans``: processes of the run (engines, reapers, serve, learner) or its sandbox containers
  left after the final stop.

Final JSON line: trials, recoveries, max_recovery_s (per kind), lost_samples, double_trained,
skipped_tasks, orphans, and the buffer's counts.

    .venv/bin/python benchmarks/chaos.py --trials 2            # 2 of each kind, about 15 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import free_port  # noqa: E402 - the benchmarks' folder is on sys.path

from agentrl.client import get_json  # noqa: E402


class Run:
    def __init__(self, run_dir: Path, model: str, env: str) -> None:
        self.run_dir, self.port, self.engine_port = run_dir, free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.serve_args = [sys.executable, "-m", "agentrl.cli", "serve", f"--run_dir={run_dir}", f"--model={model}",
                           f"--router.port={self.port}", f"--engine.base_port={self.engine_port}",
                           f"--env.name={env}", "--env.group_size=2", "--buffer.batch_size=4",
                           "--engine.restart_backoff_s=1"]
        self.learn_args = [sys.executable, "-m", "agentrl.cli", "learn", f"--serve={self.url}", f"--run_dir={run_dir}",
                           "--steps=0", "--resume=true", "--checkpoint_every=1", "--lr=1e-5"]
        self.env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
        self.serve: subprocess.Popen | None = None
        self.learner: subprocess.Popen | None = None
        self.serve_pids: list[int] = []

    def start_serve(self) -> None:
        with open(self.run_dir.parent / "serve.out", "ab") as out:
            self.serve = subprocess.Popen(self.serve_args, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.serve_pids.append(self.serve.pid)

    def start_learner(self) -> None:
        with open(self.run_dir.parent / "learn.out", "ab") as out:
            self.learner = subprocess.Popen(self.learn_args, stdout=out, stderr=subprocess.STDOUT, env=self.env)

    def token(self) -> str:
        return (self.run_dir / "admin_token").read_text().strip()

    def steps(self) -> int:
        path = self.run_dir / "learner.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def engine_pid(self) -> int | None:
        """vLLM's API server of the engine serve launched on ``engine_port`` (not its reaper, whose
        command line holds the same command)."""
        out = subprocess.run(["pgrep", "-f", f"vllm.entrypoints.openai.api_server.*--port {self.engine_port}"],
                             capture_output=True, text=True).stdout.split()
        for pid in out:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"agentrl.engines.reaper" not in cmdline:
                return int(pid)
        return None

    def engine_restarts(self) -> int:
        engines = get_json(f"{self.url}/admin/status", self.token())[1].get("engines") or [{}]
        return int(engines[0].get("restarts", 0)) if engines[0].get("state", "up") == "up" else -1

    def wait_step_after(self, steps: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.steps() > steps:
                return True
            for name, proc in (("serve", self.serve), ("learner", self.learner)):
                if proc is not None and proc.poll() is not None:
                    print(f"  {name} exited with {proc.returncode}; restarting it", flush=True)
                    self.start_serve() if name == "serve" else self.start_learner()
            time.sleep(1.0)
        return False

    def stop(self) -> None:
        for proc in (self.learner, self.serve):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def kill(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def audit(run: Run) -> dict[str, Any]:
    from agentrl.buffer import Buffer, BufferConfig
    from agentrl.buffer.log import Kind, ScanReport, scan

    acked: Counter[str] = Counter()
    for kind, payload in scan(run.run_dir / "buffer" / "buffer.log", ScanReport()):
        if kind == Kind.ACK:
            acked.update(json.loads(payload)["sample_ids"])
    buf = Buffer(BufferConfig(path=str(run.run_dir / "buffer"), group_size=2, batch_size=4))
    stats = buf.stats()
    lines = [json.loads(x) for x in (run.run_dir / "episodes.jsonl").read_text().splitlines()]
    logged = sum(line.get("num_samples", 0) for line in lines)
    cursor, open_groups = 0, {}  # a line per group start and one per end: open ones have no end
    frontier = run.run_dir / "rollout_frontier.jsonl"
    for x in frontier.read_text().splitlines() if frontier.exists() else []:
        rec = json.loads(x)
        cursor = max(cursor, rec.get("cursor", 0), rec.get("index", -1) + 1)
        if "start" in rec:
            open_groups[rec["start"]] = rec["index"]
        elif "end" in rec:
            open_groups.pop(rec["end"], None)
    seen = {int(str(line["task_id"]).rsplit("-", 1)[-1]) for line in lines}
    skipped = sorted(set(range(cursor)) - seen - set(open_groups.values()))
    buf.close()
    return {"identity": stats["identity_holds"], "produced": stats["produced"], "consumed": stats["consumed"],
            "dropped_by_reason": stats["dropped_by_reason"], "pending": stats["pending"],
            "lost_samples": max(0, logged - stats["produced"]),
            "double_trained": sum(1 for n in acked.values() if n > 1), "skipped_tasks": len(skipped),
            "tasks_drawn": cursor, "episodes": len(lines)}


def orphans(run: Run) -> int:
    procs = subprocess.run(["pgrep", "-f", f"{run.run_dir}|--port {run.engine_port}"], capture_output=True,
                           text=True).stdout.split()
    procs = [p for p in procs if int(p) != os.getpid()]
    containers = 0
    for pid in run.serve_pids:
        out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.pid={pid}"], capture_output=True,
                             text=True)
        containers += len(out.stdout.split())
    return len(procs) + containers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=2, help="kills of each kind")
    p.add_argument("--kinds", default="engine,learner,serve")
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
    recovery: dict[str, list[float]] = {k: [] for k in args.kinds.split(",")}
    failed = 0
    t0 = time.monotonic()
    try:
        run.start_serve()
        run.start_learner()
        if not run.wait_step_after(0, args.recovery_timeout_s):
            raise SystemExit(f"the run made no first step; see {base}/serve.out and {base}/learn.out")
        print(f"[{time.monotonic() - t0:6.0f}s] first learner step; {len(kinds)} kills to come", flush=True)
        for i, kind in enumerate(kinds, 1):
            steps = run.steps()
            run.wait_step_after(steps, args.recovery_timeout_s)  # steady: one more step first
            time.sleep(rng.uniform(0.0, 8.0))  # a random moment within a step
            restarts = run.engine_restarts()
            target = {"engine": run.engine_pid, "learner": lambda: run.learner.pid,
                      "serve": lambda: run.serve.pid}[kind]()
            killed = time.monotonic()
            kill(target)
            print(f"[{killed - t0:6.0f}s] trial {i}: kill -9 {kind} (pid {target})", flush=True)
            if kind == "engine":  # recovered once serve relaunched it and it is back in the pool
                while run.engine_restarts() <= restarts and time.monotonic() - killed < args.recovery_timeout_s:
                    time.sleep(1.0)
            steps = run.steps()
            ok = run.wait_step_after(steps, args.recovery_timeout_s)  # restarts what died meanwhile
            if ok:
                recovery[kind].append(time.monotonic() - killed)
                print(f"  recovered: a learner step {recovery[kind][-1]:.1f} s after the kill", flush=True)
            else:
                failed += 1
                print("  not recovered within the timeout", flush=True)
    finally:
        run.stop()
    time.sleep(3.0)
    found = audit(run)
    result = {"benchmark": "chaos", "trials": len(kinds), "recoveries": sum(len(v) for v in recovery.values()),
              "max_recovery_s": {k: round(max(v), 1) if v else None for k, v in recovery.items()},
              "recovery_s": {k: [round(x, 1) for x in v] for k, v in recovery.items()},
              **{k: found[k] for k in ("lost_samples", "double_trained", "skipped_tasks")},
              "orphans": orphans(run), "identity": found["identity"],
              "buffer": {k: found[k] for k in ("produced", "consumed", "dropped_by_reason", "pending")},
              "tasks_drawn": found["tasks_drawn"], "episodes": found["episodes"], "failed_trials": failed,
              "wall_minutes": round((time.monotonic() - t0) / 60, 2), "load_avg": round(os.getloadavg()[0], 2)}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
