"""The first command a newcomer runs, timed phase by phase: from `bash scripts/quickstart.sh` in a fresh
clone to its first `step 1` line.

Usage: python benchmarks/first_hour.py [--workdir DIR] [--fresh-machine] [--steps N]

It clones this repository's HEAD into a new folder (so the venv is new), points the model cache
(``AGENTRL_HOME``) at an empty folder and turns pip's download cache off, then runs the README's
first command exactly as written, on free ports, and reads the phases from what it prints:

- the set-up phases ``scripts/setup.sh`` times (system packages, venv, Docker, sandbox images, the
  model it installs) and the quickstart's own model phase;
- the engine's start-up: from ``agentrl run``'s start until serve answers (its "watch the run" line);
- the first step: from there to the first ``step 1`` line (the held-out evaluation before training
  is part of it, and timed on its own).

With ``--fresh-machine`` it first removes what a fresh machine lacks: the Debian packages setup
installs (``docker.io``, ``debootstrap``, ``bubblewrap``; the running Docker engine is stopped) and
the sandbox images, so the figure is a new machine's. Without it, what the machine already has is
reused and its phases are short (the JSON line says which). After the first step (or ``--steps``
steps) the run is interrupted with SIGINT, as Ctrl-C would.

Final JSON line: ``setup_s``, ``model_s``, ``engine_start_s``, ``first_step_s``,
``total_to_first_step_s`` and the phases.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import free_port, tied_to_this_process

ROOT = Path(__file__).resolve().parents[1]
PHASE = re.compile(r"^\[(setup|quickstart)\] phase (\w+) took (\d+) s")


def make_fresh() -> None:
    """Remove what setup installs, as on a new machine (needs root; stops the Docker engine)."""
    print(
        "removing docker.io (with containerd and runc), debootstrap, bubblewrap and the agentrl images",
        file=sys.stderr,
        flush=True,
    )
    images = subprocess.run(
        ["docker", "images", "-q", "--filter", "reference=agentrl/*"], capture_output=True, text=True
    ).stdout.split()
    if images:
        subprocess.run(["docker", "rmi", "-f", *images], capture_output=True)
    subprocess.run(["pkill", "-x", "dockerd"], capture_output=True)
    time.sleep(2)
    subprocess.run(
        ["apt-get", "remove", "-y", "-qq", "docker.io", "containerd", "runc", "debootstrap", "bubblewrap"],
        capture_output=True,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        check=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="", help="where the clone, its venv and the model cache go "
                                                  "(default: a new temporary folder, removed afterwards)")
    ap.add_argument("--fresh-machine", action="store_true",
                    help="first uninstall the Debian packages setup installs and remove the sandbox images")
    ap.add_argument("--steps", type=int, default=1, help="learner steps to wait for "
                                                         "before interrupting the run")
    ap.add_argument("--timeout-s", type=float, default=3600)
    args = ap.parse_args()

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="agentrl-first-hour-"))
    work.mkdir(parents=True, exist_ok=True)
    clone = work / "agentrl"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    home = work / "home"
    shutil.rmtree(home, ignore_errors=True)
    had = {name: shutil.which(name) is not None for name in ("dockerd", "debootstrap", "bwrap")}
    if args.fresh_machine:
        make_fresh()
    env = {**os.environ, "AGENTRL_HOME": str(home), "PIP_NO_CACHE_DIR": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    cmd = ["bash", "scripts/quickstart.sh", f"--serve.run_dir={work / 'run'}",
           f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}"]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=tied_to_this_process(),
    )
    assert proc.stdout is not None
    phases: dict[str, float] = {}
    at: dict[str, float] = {}
    steps = 0
    try:
        for line in proc.stdout:
            now = time.monotonic() - t0
            line = line.rstrip()
            if m := PHASE.match(line):
                phases[f"{m.group(1)}_{m.group(2)}"] = float(m.group(3))
            if line.startswith("[setup] ready"):
                at["setup_done"] = now
            if "watch the run:" in line:
                at["serve_ready"] = now
            if line.startswith("eval before: success"):
                at["eval_before_done"] = now
            if line.startswith("eval before:") and "eval_before_start" not in at:
                at["eval_before_start"] = now
            if line.startswith("step "):
                steps += 1
                at.setdefault("step_1", now)
            if (line.startswith(("[setup]", "[quickstart]", "step ", "eval ")) or "serve:" in line
                    or "ERROR" in line or "Traceback" in line):
                print(f"[{now:6.0f}s] {line}", file=sys.stderr, flush=True)
            if steps >= args.steps or now > args.timeout_s:
                break
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a person would
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if "step_1" not in at:
        raise SystemExit(f"no `step 1` line (exit {proc.returncode}); see {work / 'run'}/serve.log")
    setup_s = sum(v for k, v in phases.items() if k != "setup_model" and k.startswith("setup_"))
    model_s = phases.get("setup_model", 0.0) + phases.get("quickstart_model", 0.0)
    run_start = at["setup_done"] + phases.get("quickstart_model", 0.0)
    result = {
        "setup_s": setup_s, "model_s": model_s,
        "engine_start_s": round(at["serve_ready"] - run_start, 1),
        "first_step_s": round(at["step_1"] - at["serve_ready"], 1),
        "eval_before_s": round(at["eval_before_done"] - at["eval_before_start"], 1)
        if "eval_before_done" in at else None,
        "total_to_first_step_s": round(at["step_1"], 1),
        "phases": phases, "fresh_machine": args.fresh_machine, "had_before": had,
    }
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
