"""``agentrl eval``: held-out tasks through the agent loop against a real endpoint, with honest intervals."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import agentrl
from agentrl.rollout.config import EpisodeLimits
from agentrl.rollout.episode import EpisodeResult
from agentrl.rollout.evaluate import (
    eval_tasks,
    evaluate,
    is_success,
    mean_interval,
    tally_by_env,
    wilson_interval,
)
from tests.router_harness import serve_router

ROOT = Path(__file__).resolve().parents[1]


def test_wilson_interval_matches_hand_computed_values() -> None:
    # 8 of 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416 = 0.71675, half 0.2190 -> (0.4902, 0.9433)
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    lo, hi = wilson_interval(0, 100)  # never zero width, even with no successes
    assert lo == 0.0 and hi == pytest.approx(0.0370, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_mean_interval_is_the_normal_approximation() -> None:
    mean, lo, hi = mean_interval([0.0, 1.0, 1.0, 0.0])  # sd 0.57735, half 1.96 * 0.57735 / 2
    assert (
        mean == 0.5
        and lo == pytest.approx(0.5 - 0.565803, abs=1e-5)
        and hi == pytest.approx(0.5 + 0.565803, abs=1e-5)
    )


def test_heldout_is_the_test_split_and_disjoint_from_training_tasks() -> None:
    held = eval_tasks("guess_number", {}, "heldout", 20)
    train = eval_tasks("guess_number", {}, "train", 20)
    assert len(held) == 20 and all(t["id"].startswith("test-") for t in held)
    assert not {t["seed"] for t in held} & {t["seed"] for t in train}
    assert eval_tasks("guess_number", {}, "test", 20) == held  # same tasks every time


def test_a_mixs_evaluation_is_tallied_per_environment_too() -> None:
    tasks = [{"id": "a", "mix_env": "arithmetic"}, {"id": "b", "mix_env": "guess_number"},
             {"id": "c", "mix_env": "arithmetic"}, {"id": "d", "mix_env": "arithmetic"}]
    by_env = tally_by_env(tasks, [True, False, False, True], [1.0, 0.0, 0.0, 1.0])
    assert list(by_env) == ["arithmetic", "guess_number"]  # in the order they first appear
    a, g = by_env["arithmetic"], by_env["guess_number"]
    assert (a["n"], a["successes"], g["n"], g["successes"]) == (3, 2, 1, 0)
    assert a["success_rate"] == pytest.approx(2 / 3) and a["success_ci95"] == wilson_interval(2, 3)
    assert a["reward_mean"] == pytest.approx(2 / 3) and g["reward_ci95"] == (0.0, 0.0)
    assert tally_by_env([{"id": "a"}], [True], [1.0]) == {}  # one environment: no breakdown



def ended(reward: float, **info: object) -> EpisodeResult:
    return EpisodeResult("e", "g", "x", "t", reward=reward, terminated=True, info=dict(info))


def test_partial_credit_is_no_success_where_the_environment_declares_success() -> None:
    assert not is_success(ended(0.05, success=False))  # a well-formed wrong answer's partial credit
    assert is_success(ended(1.0, success=True))
    assert is_success(ended(0.0, success=True), success_reward=0.5)  # the declaration decides
    assert is_success(ended(0.05)) and not is_success(ended(0.05), success_reward=0.1)  # nothing declared
    cut = ended(1.0, success=True)
    cut.truncated = True
    assert not is_success(cut)


@agentrl.environment("test_partial_credit")
class PartialCredit(agentrl.Environment):
    """One question; the right answer (its id) scores 1 and is a success, anything else 0.05 and
    is not."""

    def tasks(self, split: str = "train") -> list[dict[str, str]]:
        return [{"id": str(i)} for i in range(4)]

    async def reset(self, task: dict[str, str]) -> agentrl.Reset:
        self.task = task
        return agentrl.Reset(messages=[{"role": "user", "content": "Which task is this?"}])

    async def step(self, message: dict[str, object]) -> agentrl.StepResult:
        right = message.get("content") == self.task["id"]
        return agentrl.StepResult(messages=[], reward=1.0 if right else 0.05, terminated=True,
                                  info={"success": right})


def test_eval_counts_declared_successes_and_reports_partial_credit_beside() -> None:
    from tests.test_env_adapters import ScriptedClient

    client = ScriptedClient(lambda body: "1")  # right on task 1 only
    result = asyncio.run(evaluate("test_partial_credit", client, 4))
    assert (result.successes, result.declared, result.failed) == (1, 4, 0)
    assert [ep["success"] for ep in result.episodes] == [False, True, False, False]
    assert result.reward_mean == pytest.approx((1.0 + 3 * 0.05) / 4)
    assert "declared by the environment" in result.line()


def test_a_reasoning_gym_answer_with_partial_credit_is_not_solved() -> None:
    from tests.test_env_adapters import ScriptedClient

    result = asyncio.run(evaluate("reasoning_gym:gsm_symbolic", ScriptedClient("<answer>7</answer>"), 3))
    assert result.reward_mean > 0 and result.successes == 0 and result.declared == 3


@pytest.mark.vllm
def test_evaluate_runs_heldout_episodes_against_a_real_router_endpoint(vllm_engine, tiny_tools_model) -> None:
    with serve_router([vllm_engine.url], tiny_tools_model, api_keys=frozenset({"client-key"})) as srv:
        result = asyncio.run(
            evaluate(
                "guess_number",
                f"{srv.url}/v1",
                6,
                split="heldout",
                api_key="client-key",
                limits=EpisodeLimits(max_turns=3, max_tokens=16, temperature=1.0),
                concurrency=3,
            )
        )
        assert srv.router.counters["calls"] >= 6  # every episode made real model calls
        assert not srv.router.sessions  # evaluation records nothing for training
    assert result.n == 6 and result.failed == 0 and result.model == "tiny-tools" and result.split == "test"
    assert all(ep["turns"] >= 1 for ep in result.episodes)
    assert 0.0 <= result.success_ci95[0] <= result.success_rate <= result.success_ci95[1] <= 1.0
    assert result.reward_ci95[0] <= result.reward_mean <= result.reward_ci95[1]
    assert {ep["task_id"] for ep in result.episodes} == {f"test-{i}" for i in range(6)}


@pytest.mark.vllm
def test_evaluating_a_mix_gives_each_environment_its_own_success_rate(vllm_engine, tiny_tools_model) -> None:
    config = {"envs": {"arithmetic": {}, "guess_number": {}}}
    with serve_router([vllm_engine.url], tiny_tools_model) as srv:
        result = asyncio.run(
            evaluate(
                "mix",
                f"{srv.url}/v1",
                6,
                split="heldout",
                env_config=config,
                limits=EpisodeLimits(max_turns=2, max_tokens=16, temperature=1.0),
                concurrency=3,
            )
        )
    assert result.n == 6 and result.failed == 0  # arithmetic's episodes ran in Docker sandboxes of their own
    assert set(result.by_env) == {"arithmetic", "guess_number"}
    assert [e["n"] for e in result.by_env.values()] == [3, 3]  # interleaved evenly
    assert sum(e["successes"] for e in result.by_env.values()) == result.successes
    for name, e in result.by_env.items():
        won = [ep["success"] for ep in result.episodes if ep["mix_env"] == name]
        assert e["successes"] == sum(won) and e["success_ci95"] == wilson_interval(sum(won), len(won))
    assert "arithmetic: 3 tasks" in result.line() and "guess_number: 3 tasks" in result.line()


@pytest.mark.vllm
def test_agentrl_eval_command_writes_a_json_result_and_reads_the_key_from_a_file(
    vllm_engine, tiny_tools_model, tmp_path: Path
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("client-key\n")
    key_file.chmod(0o600)
    out_file = tmp_path / "eval.json"
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTRL_API_KEY", "OPENAI_API_KEY")}
    with serve_router([vllm_engine.url], tiny_tools_model, api_keys=frozenset({"client-key"})) as srv:
        cmd = [
            sys.executable, "-m", "agentrl.cli", "eval",
            "--env",
            "guess_number",
            "--endpoint",
            f"{srv.url}/v1",
            "--tasks",
            "4",
            "--max-turns",
            "2",
            "--max-tokens",
            "8",
            "--api-key-file",
            str(key_file),
            "--out",
            str(out_file),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        refused = subprocess.run(
            cmd[:-4] + ["--out", str(tmp_path / "no.json")],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env=env,
        )  # no key: the router says so
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["n"] == 4 and summary["failed"] == 0 and "success_ci95" in summary
    assert "success" in out.stdout.splitlines()[0] and "95% CI" in out.stdout.splitlines()[0]
    saved = json.loads(out_file.read_text())
    assert len(saved["episodes"]) == 4 and saved["endpoint"].endswith("/v1")
    assert refused.returncode != 0 and "invalid API key" in refused.stderr


def test_agentrl_eval_names_an_unknown_environment() -> None:
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "eval", "--env", "no_such_env", "--endpoint",
                          "http://127.0.0.1:9/v1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode != 0 and "no_such_env" in out.stderr
