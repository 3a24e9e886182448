"""``agentrl run``: serve in a child process and the learner in this one, on one machine.

The child is started with the serve section written to ``run_dir/serve.toml``; it is stopped
(SIGTERM, then SIGKILL) when the learner finishes or fails, and dies with us if we are killed.
The admin token never appears on the child's command line: it is settled first and written to
``run_dir/admin_token`` (mode 0600), which ``serve.toml`` (also 0600) names as ``admin_token_file``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentrl.config import RunConfig, ServeConfig, to_toml

log = logging.getLogger(__name__)


def serve_command(serve_cfg: ServeConfig, run_dir: Path) -> list[str]:
    """Write ``run_dir/serve.toml`` (0600, no token in it) and return the serve child's argv."""
    cfg = dataclasses.replace(serve_cfg, admin_token="", admin_token_file=str((run_dir / "admin_token").resolve()))
    path = run_dir / "serve.toml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # router.api_keys may be in it
    with os.fdopen(fd, "w") as f:
        f.write(to_toml(cfg))
    path.chmod(0o600)
    return [sys.executable, "-m", "agentrl.engines.reaper", "--",
            sys.executable, "-m", "agentrl.cli", "serve", "--config", str(path)]


def run(cfg: RunConfig) -> int:
    from agentrl.learner.trainer import learn
    from agentrl.serve import admin_token_for

    run_dir = Path(cfg.serve.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Settle the admin token before either side starts: serve reads its file, the learner gets it.
    token = admin_token_for(cfg.serve, run_dir)
    cmd = serve_command(cfg.serve, run_dir)
    learn_cfg = cfg.learn
    learn_cfg.serve = f"http://{cfg.serve.router.host}:{cfg.serve.router.port}"
    learn_cfg.run_dir = cfg.serve.run_dir
    learn_cfg.admin_token = learn_cfg.admin_token or token
    learn_cfg.batch_size = cfg.serve.buffer.batch_size
    learn_cfg.max_staleness = cfg.serve.buffer.max_staleness
    log.info("starting serve (log: %s)", run_dir / "serve.log")
    with open(run_dir / "serve.log", "ab") as logf:
        serve = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    t0 = time.monotonic()
    try:
        history = learn(learn_cfg)
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
    summary = {"steps": len(history), "final_version": history[-1]["version"] if history else 0,
               "reward_by_step": [round(h["reward_mean"], 4) for h in history],
               "wall_minutes": round((time.monotonic() - t0) / 60, 2), "run_dir": str(run_dir)}
    print(json.dumps(summary), flush=True)
    return 0
