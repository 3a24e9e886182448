"""`agentrl run`, the quickstart's last step, on a fresh run directory: serve + learner on one machine."""

from __future__ import annotations

import json

import pytest

from tests.conftest import agentrl_run

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]


def test_agentrl_run_trains_three_steps_and_prints_each(tmp_path, tiny_tools_model):
    out = agentrl_run(tmp_path / "run", "--serve.env.group_size=2", "--serve.buffer.batch_size=4", "--learn.steps=3",
                      "--eval.tasks=6")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for k in (1, 2, 3):
        assert any(line.startswith(f"step {k} | version {k} | reward ") and "staleness" in line for line in lines)
    summary = json.loads(lines[-1])
    assert summary["steps"] == 3 and summary["final_version"] == 3
    assert (tmp_path / "run" / "episodes.jsonl").exists()
    # Held-out evaluation before the first step and after the last, on the same tasks.
    assert summary["eval_tasks"] == 6 and 0 <= summary["success_before"] <= 1 and 0 <= summary["success_after"] <= 1
    before = json.loads((tmp_path / "run" / "eval_before.json").read_text())
    after = json.loads((tmp_path / "run" / "eval_after.json").read_text())
    assert len(before["episodes"]) == len(after["episodes"]) == 6
    assert [e["task_id"] for e in before["episodes"]] == [e["task_id"] for e in after["episodes"]]
    assert any(line.startswith("success on held-out tasks: ") for line in lines)
    assert list((tmp_path / "run" / "plots").glob("*.png"))
