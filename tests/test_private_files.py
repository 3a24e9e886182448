"""A run directory and the files serve writes into it are private to the user (0700 / 0600),
whatever the shell's umask: the buffer's samples, the sessions' records and the weights are data
others on the machine must not read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_serve_writes_its_run_directory_private_even_under_a_permissive_umask(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRL_")}
    # an engine nobody runs: serve still comes up (its pool marks it down) and writes its run directory
    cmd = [
        sys.executable, "-m", "agentrl.cli", "serve", f"--run_dir={run_dir}", f"--router.port={port}",
        f'--engine.urls=["http://127.0.0.1:{free_port()}"]', "--env.name=guess_number",
        "--endpoint_only=true", "--router.render=engine",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: os.umask(0o022))
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "buffer" / "buffer.log").exists() or not (run_dir / "weights").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "serve did not write its run directory"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    paths = [p for p in [run_dir, *run_dir.rglob("*")]]
    assert len(paths) >= 5
    wide = [
        (str(p.relative_to(tmp_path)), oct(p.stat().st_mode & 0o777))
        for p in paths
        if p.stat().st_mode & 0o077
    ]
    assert not wide, wide
