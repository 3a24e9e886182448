"""`agentrl run`, the quickstart's last step, on a fresh run directory: serve + learner on one machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]


def test_agentrl_run_trains_three_steps_and_prints_each(tmp_path, tiny_tools_model):
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}  # as a newcomer runs it
    cmd = [sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={tmp_path / 'run'}",
           f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
           "--serve.env.group_size=2", "--serve.buffer.batch_size=4"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for k in (1, 2, 3):
        assert any(line.startswith(f"step {k} | version {k} | reward ") and "staleness" in line for line in lines)
    summary = json.loads(lines[-1])
    assert summary["steps"] == 3 and summary["final_version"] == 3
    assert (tmp_path / "run" / "episodes.jsonl").exists()
