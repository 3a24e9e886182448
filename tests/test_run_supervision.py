"""``agentrl run`` starts a serve child that died again (restored), with a bound: unit tests of
:class:`agentrl.cli.run.ServeChild` on stand-in child programs (the real serve, killed mid-run, is
in ``tests/test_run.py``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import agentrl.cli.run as run_mod
from agentrl.config import ServeConfig


def _child(monkeypatch: pytest.MonkeyPatch, code: str) -> list[bool]:
    """Make ServeChild start ``python -c code`` instead of serve; returns each start's ``restore``."""
    starts: list[bool] = []

    def command(cfg: ServeConfig, run_dir: Path) -> list[str]:
        starts.append(cfg.restore)
        return [sys.executable, "-c", code]

    monkeypatch.setattr(run_mod, "serve_command", command)
    return starts


def test_a_serve_that_keeps_dying_is_started_again_restored_then_the_run_is_stopped(tmp_path, monkeypatch):
    starts = _child(monkeypatch, "import sys; sys.exit(3)")
    child = run_mod.ServeChild(ServeConfig(restore=False), tmp_path, restarts=2, backoff_s=0.01)
    child.start()
    child.supervise()
    deadline = time.monotonic() + 60
    with pytest.raises(KeyboardInterrupt):  # the watcher interrupts the main thread (the learner)
        while time.monotonic() < deadline:
            time.sleep(0.05)
    child.stop()
    assert starts == [False, True, True]  # the first as configured, each relaunch restoring the weights
    assert child.relaunched == 2
    assert "serve exited with code 3 and was relaunched 2 times in a row" in child.failed
    assert child.poll() == 3


def test_a_serve_that_runs_is_left_alone_and_stop_ends_it_without_a_relaunch(tmp_path, monkeypatch):
    starts = _child(monkeypatch, "import time; time.sleep(120)")
    child = run_mod.ServeChild(ServeConfig(), tmp_path, restarts=3, backoff_s=0.01)
    child.start()
    child.supervise()
    time.sleep(1.0)
    assert child.poll() is None
    child.stop(timeout_s=10)
    assert starts == [True] and child.relaunched == 0 and child.failed == ""
    assert child.proc is not None and child.proc.returncode is not None


def test_no_restarts_means_a_dead_serve_stops_the_run(tmp_path, monkeypatch):
    starts = _child(monkeypatch, "import sys; sys.exit(1)")
    child = run_mod.ServeChild(ServeConfig(), tmp_path, restarts=0)
    child.start()
    child.supervise()
    deadline = time.monotonic() + 60
    with pytest.raises(KeyboardInterrupt):
        while time.monotonic() < deadline:
            time.sleep(0.05)
    child.stop()
    assert starts == [True] and child.relaunched == 0 and "relaunched 0 times" in child.failed
