"""Chaos on a real run: kill -9 the engine, the learner and serve at random moments, then audit.

A real run on this machine: ``agentrl serve`` (its vLLM engine, Docker sandboxes, the buffer) and
``agentrl learn --resume`` as two processes. :class:`Run` is their process supervisor (what systemd,
Kubernetes or the compose file's restart policy is in production): it restarts serve or the learner
whenever one has died; the engine is relaunched by serve itself. A kill counts as recovered once the
learner has finished a step after it; its recovery time runs from the kill to that step.

A round (:func:`play`) kills one process once the run is steady (a learner step since the last
round), then, while the run recovers from that, kills the restarted learner ``learner_kills`` more
times at random moments: every kill is a trial, and a round ends with the first step after its last
kill. The CI test (``tests/test_chaos.py``) plays its trials in such rounds so that outages overlap;
``benchmarks/chaos.py`` plays one kill per round and more of them.

The audit (:func:`audit`), once everything is stopped:

- ``identity``: the buffer, recovered from its log, satisfies produced = consumed + dropped + pending;
- ``lost_samples``: samples of episodes whose put serve acknowledged (their ``episodes.jsonl``
  line) that the buffer does not have;
- ``double_trained``: sample ids acknowledged by the learner in more than one batch;
- ``skipped_tasks``: task indices below the rollout's cursor with no episode (tasks of groups still
  open in the frontier at the end are left out: they resume on the next start);
- ``orphans`` (:func:`orphans`): processes of the run (engines, reapers, serve, learner) or its
  sandbox containers left after the final stop.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.client import get_json
from agentrl.engines.reaper import stop_process
from tests.conftest import free_port

KINDS = ("engine", "learner", "serve")


class Run:
    """serve and a resuming learner on ``run_dir``, restarted by :meth:`supervise` when they die."""

    def __init__(self, run_dir: Path, model: str, env: str, *serve_settings: str) -> None:
        self.run_dir, self.port, self.engine_port = run_dir, free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.serve_args = [
            sys.executable, "-m", "agentrl.cli", "serve",
            f"--run_dir={run_dir}",
            f"--model={model}",
            f"--router.port={self.port}",
            f"--engine.base_port={self.engine_port}",
            f"--env.name={env}",
            "--env.group_size=2",
            "--buffer.batch_size=4",
            "--engine.restart_backoff_s=1",
            *serve_settings,
        ]
        self.learn_args = [
            sys.executable, "-m", "agentrl.cli", "learn",
            f"--serve={self.url}",
            f"--run_dir={run_dir}",
            "--steps=0",
            "--resume=true",
            "--checkpoint_every=1",
            "--lr=1e-5",
        ]
        self.env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
        self.serve: subprocess.Popen | None = None
        self.learner: subprocess.Popen | None = None
        self.serve_pids: list[int] = []
        self.restarted: Counter[str] = Counter()

    def start_serve(self) -> None:
        with open(self.run_dir.parent / "serve.out", "ab") as out:
            self.serve = subprocess.Popen(self.serve_args, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.serve_pids.append(self.serve.pid)

    def start_learner(self) -> None:
        with open(self.run_dir.parent / "learn.out", "ab") as out:
            self.learner = subprocess.Popen(
                self.learn_args, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )

    def supervise(self) -> None:
        """Restart serve or the learner if it has exited (whatever its exit code)."""
        for name, proc, start in (
            ("serve", self.serve, self.start_serve),
            ("learner", self.learner, self.start_learner),
        ):
            if proc is not None and proc.poll() is not None:
                print(f"  {name} exited with {proc.returncode}; restarting it", flush=True)
                self.restarted[name] += 1
                start()

    def token(self) -> str:
        return (self.run_dir / "admin_token").read_text().strip()

    def steps(self) -> int:
        path = self.run_dir / "learner.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def engine_pid(self) -> int | None:
        """vLLM's API server of the engine serve launched on ``engine_port``."""
        pids = running_pids(f"vllm.entrypoints.openai.api_server.*--port {self.engine_port}")
        return pids[0] if pids else None

    def engine_restarts(self) -> int:
        """How often serve has relaunched its engine (-1 while serve does not answer or the engine is
        not up)."""
        try:
            status, body = get_json(f"{self.url}/admin/status", self.token(), timeout_s=10.0)
        except (OSError, ValueError):  # the token file not written yet, or a body cut short
            return -1
        engines = body.get("engines") or [{}]
        return int(engines[0].get("restarts", 0)) if status == 200 and engines[0].get("state") == "up" else -1

    def wait(self, until: Any, timeout_s: float) -> bool:
        """Supervise until ``until()`` holds; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if until():
                return True
            self.supervise()
            time.sleep(0.5)
        return False

    def wait_step_after(self, steps: int, timeout_s: float) -> bool:
        return self.wait(lambda: self.steps() > steps, timeout_s)

    def _proc(self, kind: str) -> subprocess.Popen | None:
        return {"learner": self.learner, "serve": self.serve}.get(kind)

    def target(self, kind: str) -> int | None:
        proc = self._proc(kind)
        return self.engine_pid() if kind == "engine" else proc.pid if proc and proc.poll() is None else None

    def kill(self, kind: str) -> int | None:
        """kill -9 the ``kind`` process, if it runs, and reap it (so :meth:`supervise` sees it gone)."""
        pid = self.target(kind)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc = self._proc(kind)
            if proc is not None:
                proc.wait(30)
        return pid

    def stop(self) -> None:
        for proc in (self.learner, self.serve):
            if proc is not None:
                stop_process(proc, 120, kill_wait_s=10)


def running_pids(pattern: str) -> list[int]:
    """Processes whose command line matches ``pattern`` (``pgrep -f``), leaving out the reapers that
    launched them (a reaper's command line holds its child's command)."""
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in out:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agentrl.engines.reaper" not in cmdline:
            pids.append(int(pid))
    return pids


@dataclass
class Trials:
    """What the kills of a chaos run gave: recovery seconds per kind, and kills never recovered."""

    recovery_s: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    failed: int = 0
    log: list[str] = field(default_factory=list)

    @property
    def trials(self) -> int:
        return sum(len(v) for v in self.recovery_s.values()) + self.failed


def play(run: Run, kind: str, rng: random.Random, trials: Trials, *, learner_kills: int = 0,
         timeout_s: float = 600.0, t0: float = 0.0) -> None:
    """One round: once the run is steady, kill -9 ``kind``; while it recovers, kill the learner
    ``learner_kills`` more times at random moments (each as soon as it runs again, after 0-6 s);
    then wait for a learner step. Every kill is a trial of ``trials``."""
    run.wait_step_after(run.steps(), timeout_s)  # steady: one more step first
    time.sleep(rng.uniform(0.0, 8.0))  # a random moment within a step
    kills: list[tuple[str, float]] = []
    restarts = run.engine_restarts()
    for i, what in enumerate([kind] + ["learner"] * learner_kills):
        if i:
            run.wait(lambda: run.target("learner") is not None, timeout_s)
            time.sleep(rng.uniform(0.0, 6.0))
        killed = time.monotonic()
        pid = run.kill(what)
        kills.append((what, killed))
        trials.log.append(f"[{killed - t0:6.0f}s] kill -9 {what} (pid {pid})")
        print(trials.log[-1], flush=True)
    if kind == "engine":  # recovered once serve relaunched it and it is back in the pool
        run.wait(lambda: run.engine_restarts() > restarts, timeout_s)
    steps = run.steps()
    ok = run.wait_step_after(steps, timeout_s)
    done = time.monotonic()
    for what, killed in kills:
        if ok:
            trials.recovery_s[what].append(done - killed)
        else:
            trials.failed += 1
    print(f"  {'recovered' if ok else 'NOT recovered'}: a learner step {done - kills[0][1]:.1f} s after the "
          f"round's first kill", flush=True)


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
        out = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=agentrl.pid={pid}"], capture_output=True, text=True
        )
        containers += len(out.stdout.split())
    return len(procs) + containers


def report(run: Run, trials: Trials, t0: float) -> dict[str, Any]:
    """Stop the run, audit it and return the figures (the benchmark's final JSON line)."""
    run.stop()
    time.sleep(3.0)
    found = audit(run)
    rec = trials.recovery_s
    return {
        "trials": trials.trials,
        "recoveries": sum(len(v) for v in rec.values()),
        "max_recovery_s": {k: round(max(v), 1) if v else None for k, v in rec.items()},
        "recovery_s": {k: [round(x, 1) for x in v] for k, v in rec.items()},
        **{k: found[k] for k in ("lost_samples", "double_trained", "skipped_tasks")},
        "orphans": orphans(run),
        "identity": found["identity"],
        "buffer": {k: found[k] for k in ("produced", "consumed", "dropped_by_reason", "pending")},
        "tasks_drawn": found["tasks_drawn"],
        "episodes": found["episodes"],
        "failed_trials": trials.failed,
        "restarted": dict(run.restarted),
        "wall_minutes": round((time.monotonic() - t0) / 60, 2),
        "load_avg": round(os.getloadavg()[0], 2),
    }
