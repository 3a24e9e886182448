"""Chaos on a real run: kill -9 the engine, serve and the learner, and stall the engine, at random
moments; then audit every sample by id.

A real run on this machine: ``agentrl serve`` (its vLLM engine, Docker sandboxes, the buffer) and
``agentrl learn --resume`` as two processes. :class:`Run` is their process supervisor (what systemd,
Kubernetes or the compose file's restart policy is in production): it restarts serve or the learner
whenever one has died; the engine is relaunched by serve itself, also when it stalls (SIGSTOP of its
engine core: alive, no progress; serve runs with ``engine.stall_s`` 10 s).

A round (:func:`play`) is a sequence of faults. Its first comes once the run is steady (a learner
step since the last round), at a random moment; each next one comes, at a random moment, while the
run recovers from the ones before: serve killed while it relaunches a stalled engine, the engine
killed while serve starts it, the learner killed while both come back. Every fault is a trial; a
round is recovered from once the engine is up again and the learner has finished a step, and that
time counts for each of its trials. ``ROUNDS`` gives each kind the same number of trials.

The audit (:func:`audit`), once everything is stopped, follows every sample id (the buffer's log
has each put, ack and drop; ``episodes.jsonl`` has the ids of each episode serve acknowledged):

- ``identity``: the recovered buffer's counters satisfy produced = consumed + dropped + pending;
- ``unaccounted``: produced ids that are neither consumed, dropped for a named reason, nor pending
  (and ids whose recovered state disagrees with the log);
- ``lost_samples``: ids of acknowledged episodes that the buffer never took;
- ``double_trained``: ids acknowledged in more than one batch (an acknowledged id served again
  and trained is acknowledged again), or batches trained at two learner steps;
- ``skipped_tasks``: task indices below the rollout's cursor without their full group of episodes
  and without a named reason (their group still open at the end: it resumes on the next start);
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
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from agentrl.client import get_json
from agentrl.engines.reaper import stop_process
from agentrl.procs import tied_to_this_process
from tests.conftest import free_port

KINDS = ("engine", "serve", "learner", "stall")
# Five rounds of one fault of each kind: 20 trials, five of each. A stall opens each round (it needs
# an engine with calls in flight); the order of the engine and serve kills that follow alternates.
ROUNDS = [["stall", "serve", "engine", "learner"], ["stall", "engine", "serve", "learner"]] * 2 + [
    ["stall", "serve", "engine", "learner"]]
GROUP_SIZE = 2


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
            f"--env.group_size={GROUP_SIZE}",
            "--buffer.batch_size=4",
            "--engine.restart_backoff_s=1",
            "--engine.stall_s=10",
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
            self.serve = subprocess.Popen(self.serve_args, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                          preexec_fn=tied_to_this_process())
        self.serve_pids.append(self.serve.pid)

    def start_learner(self) -> None:
        with open(self.run_dir.parent / "learn.out", "ab") as out:
            self.learner = subprocess.Popen(
                self.learn_args, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                preexec_fn=tied_to_this_process(),
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

    def engine_core_pid(self) -> int | None:
        """The engine core process under the engine's API server (the one that steps the model)."""
        api = self.engine_pid()
        try:
            cores = [p.pid for p in psutil.Process(api).children(recursive=True)
                     if "EngineCore" in p.name() + " ".join(p.cmdline())] if api else []
        except psutil.Error:  # it went away while we looked
            return None
        return cores[0] if cores else None

    def engine_status(self) -> dict[str, Any]:
        """serve's status of its engine ({} while serve does not answer)."""
        try:
            status, body = get_json(f"{self.url}/admin/status", self.token(), timeout_s=10.0)
        except (OSError, ValueError):  # the token file not written yet, or a body cut short
            return {}
        return (body.get("engines") or [{}])[0] if status == 200 else {}

    def engine_up(self) -> bool:
        """serve answers and its engine is up."""
        return self.engine_status().get("state") == "up"

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
        if kind == "engine":
            return self.engine_pid()
        if kind == "stall":
            return self.engine_core_pid()
        proc = self._proc(kind)
        return proc.pid if proc and proc.poll() is None else None

    def calls_in_flight(self) -> int:
        """Calls serve has in flight on its engine (0 while serve does not answer)."""
        return int(self.engine_status().get("outstanding", 0))

    def stall(self, timeout_s: float) -> int | None:
        """SIGSTOP the engine core at a moment it has calls in flight (a stall is work that makes no
        progress; with none in flight, e.g. while the learner waits on a weight update, nothing is
        stuck yet): stop it, and if no call is in flight then, let it go on (SIGCONT) and try again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid = self.target("stall")
            if pid is not None and self.calls_in_flight() > 0:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    continue
                time.sleep(0.5)
                if self.calls_in_flight() > 0:
                    return pid
                os.kill(pid, signal.SIGCONT)
            self.supervise()
            time.sleep(0.5)
        return None

    def fault(self, kind: str, timeout_s: float = 600.0) -> int | None:
        """kill -9 the ``kind`` process (SIGSTOP the engine core with calls in flight for a stall), if
        it runs, and reap a killed child (so :meth:`supervise` sees it gone)."""
        if kind == "stall":
            return self.stall(timeout_s)
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


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@dataclass
class Trials:
    """What the faults of a chaos run gave: recovery seconds per kind, and faults never recovered."""

    recovery_s: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    failed: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)

    @property
    def by_kind(self) -> dict[str, int]:
        return {k: len(self.recovery_s[k]) + self.failed[k] for k in KINDS}

    @property
    def trials(self) -> int:
        return sum(self.by_kind.values())


def play(run: Run, faults: list[str], rng: random.Random, trials: Trials, *, timeout_s: float = 600.0,
         t0: float = 0.0) -> bool:
    """One round: once the run is steady, the first of ``faults``; each next one at a random moment
    (0-4 s) once its target runs again (an engine serve has launched since the last engine fault,
    a restarted serve or learner); then wait for the engine to be up and a learner step. A stall
    counts as seen once serve has killed the stopped engine; the next fault waits for that. Whether
    the run recovered."""
    assert "stall" not in faults[1:], "a stall needs an engine with calls in flight: it opens a round"
    run.wait_step_after(run.steps(), timeout_s)  # steady: one more step first
    time.sleep(rng.uniform(0.0, 5.0))  # a random moment within a step
    done_engines: set[int] = set()  # API servers stalled or killed (or dying with serve) this round
    kills: list[tuple[str, float]] = []
    unseen = 0  # stalls serve did not see
    for i, kind in enumerate(faults):
        if i:
            if kind == "engine":
                run.wait(lambda: run.engine_pid() not in done_engines | {None}, timeout_s)
            else:
                run.wait(lambda k=kind: run.target(k) is not None, timeout_s)
            time.sleep(rng.uniform(0.0, 4.0))
        api = run.engine_pid()
        at = time.monotonic()
        pid = run.fault(kind, timeout_s)
        kills.append((kind, at))
        trials.log.append(f"[{at - t0:6.0f}s] {'SIGSTOP engine core' if kind == 'stall' else 'kill -9'} "
                          f"{'' if kind == 'stall' else kind} (pid {pid})")
        print(trials.log[-1], flush=True)
        if kind in ("stall", "engine", "serve") and api is not None:
            done_engines.add(api)
        if kind == "stall":  # seen: serve killed the stopped engine
            seen = pid is not None and run.wait(lambda p=pid: gone(p), timeout_s)
            unseen += not seen
            trials.log.append(f"[{time.monotonic() - t0:6.0f}s]   stall {'seen' if seen else 'NOT seen'}")
            print(trials.log[-1], flush=True)
    ok = run.wait(lambda: run.engine_pid() not in done_engines | {None} and run.engine_up(), timeout_s)
    ok = ok and run.wait_step_after(run.steps(), timeout_s)
    done = time.monotonic()
    for kind, at in kills:
        if ok and not (kind == "stall" and unseen):
            trials.recovery_s[kind].append(done - at)
        else:
            trials.failed[kind] += 1
    print(f"  {'recovered' if ok else 'NOT recovered'}: engine up and a learner step "
          f"{done - kills[0][1]:.1f} s after the round's first fault", flush=True)
    return ok


def audit(run: Run) -> dict[str, Any]:
    """Follow every sample id through the buffer's log, its recovered state, the episode log and
    the learner's steps (see the module doc)."""
    from agentrl.buffer import Buffer, BufferConfig
    from agentrl.buffer.journal import Acked, Dropped, Put, decode_record
    from agentrl.buffer.log import ScanReport, scan

    produced: dict[str, str] = {}  # sample id -> its episode id
    batches: set[str] = set()  # acknowledged batches
    acked_in: dict[str, list[str]] = defaultdict(list)  # sample id -> the batches that acked it
    dropped: dict[str, str] = {}  # sample id -> reason
    for kind, payload in scan(run.run_dir / "buffer" / "buffer.log", ScanReport()):
        rec = decode_record(kind, payload)
        if isinstance(rec, Put):
            produced[rec.entry.sample_id] = rec.entry.episode_id
        elif isinstance(rec, Acked) and rec.batch_id not in batches:  # an ack is idempotent
            batches.add(rec.batch_id)
            for sid in rec.sample_ids:
                acked_in[sid].append(rec.batch_id)
        elif isinstance(rec, Dropped):
            for sid in rec.sample_ids:
                dropped[sid] = rec.reason
    buf = Buffer(BufferConfig(path=str(run.run_dir / "buffer"), group_size=GROUP_SIZE, batch_size=4))
    stats = buf.stats()
    unaccounted = []
    for sid in produced:
        state = buf.sample_state(sid)
        expected = ("consumed" if sid in acked_in else f"dropped:{dropped[sid]}" if sid in dropped
                    else None)
        if state is None or (expected is None and state not in ("pending", "leased")) or (
                expected is not None and state != expected):
            unaccounted.append((sid, state, expected))
    buf.close()

    lines = [json.loads(x) for x in (run.run_dir / "episodes.jsonl").read_text().splitlines()]
    lost = [sid for line in lines for sid in line.get("sample_ids", []) if sid not in produced]
    double = [sid for sid, b in acked_in.items() if len(b) > 1]
    # a batch trained at two of the learner's steps
    steps = [json.loads(x) for x in (run.run_dir / "learner.jsonl").read_text().splitlines()]
    trained_at = Counter(s["batch_id"] for s in steps)
    double += [b for b, n in trained_at.items() if n > 1]

    cursor, open_groups = 0, {}  # a line per group start and one per end: open ones have no end
    frontier = run.run_dir / "rollout_frontier.jsonl"
    for x in frontier.read_text().splitlines() if frontier.exists() else []:
        rec = json.loads(x)
        cursor = max(cursor, rec.get("cursor", 0), rec.get("index", -1) + 1)
        if "start" in rec:
            open_groups[rec["start"]] = rec["index"]
        elif "end" in rec:
            open_groups.pop(rec["end"], None)
    # a task's episodes: those logged, and those whose samples the buffer took (a kill can fall
    # between the put and the log line)
    task_of_episode = {line["episode_id"]: line["task_id"] for line in lines}
    for line in lines:
        for sid in line.get("sample_ids", []):
            task_of_episode.setdefault(produced.get(sid, ""), line["task_id"])
    episodes_of: dict[int, set[str]] = defaultdict(set)
    for ep, task in task_of_episode.items():
        episodes_of[int(str(task).rsplit("-", 1)[-1])].add(ep)
    skipped = [i for i in range(cursor)
               if len(episodes_of[i]) < GROUP_SIZE and i not in set(open_groups.values())]
    return {"identity": stats["identity_holds"], "produced": stats["produced"], "consumed": stats["consumed"],
            "dropped_by_reason": stats["dropped_by_reason"], "pending": stats["pending"],
            "audited_ids": len(produced), "unaccounted": len(unaccounted), "lost_samples": len(lost),
            "double_trained": len(double), "skipped_tasks": len(skipped),
            "tasks_drawn": cursor, "episodes": len(lines),
            "examples": {"unaccounted": unaccounted[:5], "lost": lost[:5], "double": double[:5],
                         "skipped": skipped[:5]}}


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
        "trials_by_kind": trials.by_kind,
        **{k: found[k] for k in ("lost_samples", "double_trained", "skipped_tasks")},
        "orphans": orphans(run),
        **{k: found[k] for k in ("audited_ids", "unaccounted", "identity", "examples")},
        "buffer": {k: found[k] for k in ("produced", "consumed", "dropped_by_reason", "pending")},
        "tasks_drawn": found["tasks_drawn"],
        "episodes": found["episodes"],
        "failed_trials": dict(trials.failed),
        "restarted": dict(run.restarted),
        "wall_minutes": round((time.monotonic() - t0) / 60, 2),
        "load_avg": round(os.getloadavg()[0], 2),
    }
