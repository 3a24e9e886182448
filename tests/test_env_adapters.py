"""Ecosystem adapters without an engine: names, splits, the ecosystems' own scoring, and failures.

The model side is a stand-in ChatClient (a unit test of the code above the router); the
environments are the ecosystems' real ones. The vLLM episodes are in test_env_adapters_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import agentrl
from agentrl.env import UnknownEnvironmentError, adapters, lookup, make
from agentrl.env.cli import list_envs
from agentrl.rollout.episode import EpisodeLimits, run_episode
from tests.conftest import after_help

ROOT = Path(__file__).resolve().parents[1]


class ScriptedClient:
    """A ChatClient whose replies come from ``reply(body)``; it records the bodies it got."""

    model_name = "scripted"

    def __init__(self, reply: Any) -> None:
        self.reply, self.bodies = (reply if callable(reply) else (lambda body: reply)), []

    async def begin(self, session_id: str, **kw: Any) -> None:
        pass

    async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
        self.bodies.append(json.loads(json.dumps(body)))
        message = self.reply(body)
        message = message if isinstance(message, dict) else {"role": "assistant", "content": message}
        return {
            "id": f"chatcmpl-{len(self.bodies)}",
            "object": "chat.completion",
            "created": 0,
            "model": "scripted",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
        }

    async def end(self, session_id: str) -> None:
        return None


def play(
    name: str, task: dict[str, Any], reply: Any, env_config: dict[str, Any] | None = None, **limits: Any
) -> Any:
    limits = {
        "max_turns": 12,
        "max_tokens": 16,
        "max_episode_tokens": 1000,
        "episode_timeout_s": 120,
        **limits,
    }
    return asyncio.run(run_episode(ScriptedClient(reply), name, task, group_id="g", env_config=env_config,
                                   limits=EpisodeLimits(**limits)))


def test_an_ecosystem_name_with_a_typo_says_what_the_ecosystem_offers() -> None:
    with pytest.raises(UnknownEnvironmentError, match="close: basic_arithmetic"):
        lookup("reasoning_gym:basic_arith")
    with pytest.raises(UnknownEnvironmentError, match="TextArena has no game"):
        lookup("textarena:NoSuchGame-v0")


def test_an_unknown_name_says_which_ecosystems_are_installed_and_how_to_add_one(monkeypatch) -> None:
    with pytest.raises(UnknownEnvironmentError) as err:
        lookup(f"nothing_{uuid.uuid4().hex[:6]}")
    assert "ecosystems installed: " in str(err.value) and "reasoning_gym:" in str(err.value)
    missing = adapters.Ecosystem("nowhere", "agentrl.env.adapters.nowhere", "no_such_package_xyz",
                                 "pip install 'agentrl[nowhere]'", "nowhere:x")
    monkeypatch.setitem(adapters.ECOSYSTEMS, "nowhere", missing)
    with pytest.raises(UnknownEnvironmentError, match=r"not installed: pip install 'agentrl\[nowhere\]'"):
        lookup("nowhere:thing")


def test_the_adapters_import_no_ecosystem_until_one_is_used() -> None:
    out = after_help("import agentrl.env, agentrl.env.adapters as "
                     "a\na.installed()\nprint('LOADED', [m for m in ('reasoning_gym', "
                     "'textarena', 'openenv', 'verifiers', 'gradio') if m in sys.modules])")
    assert "LOADED []" in out.stdout, out.stdout + out.stderr


def test_envs_list_shows_what_each_installed_ecosystem_offers() -> None:
    lines: list[str] = []
    list_envs(lines.append, per_ecosystem=3)
    text = "".join(lines)
    for section in ("[reasoning_gym]", "[textarena]", "[openenv]", "[harbor]", "[verifiers]"):
        assert section in text, text
    assert "openenv:number_guess" in text and "harbor:shipped" in text and "verifiers:vf_arith" in text
    assert "guess_number" in text  # the built-ins are still listed


# -- reasoning-gym ---------------------------------------------------------------------------------

def test_reasoning_gym_splits_are_seeded_and_never_overlap() -> None:
    env = make("reasoning_gym:basic_arithmetic", size=400, test_size=100,
               dataset_config={"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"]})
    train, test = list(env.tasks("train")), list(env.tasks("test"))
    assert len(test) == 100 and 0 < len(train) <= 400
    assert not {t["question"] for t in train} & {t["question"] for t in test}  # small sums repeat: filtered
    again = make("reasoning_gym:basic_arithmetic", size=400, test_size=100,
                 dataset_config={"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"]})
    assert [t["question"] for t in again.tasks("test")] == [t["question"] for t in test]


def test_reasoning_gym_scores_with_the_datasets_own_parser_and_verifier() -> None:
    task = next(iter(make("reasoning_gym:basic_arithmetic").tasks("test")))
    right = play("reasoning_gym:basic_arithmetic", task, f"Sure. <answer>{task['answer']}</answer>")
    assert (right.reward, right.terminated, right.error) == (1.0, True, None)
    # no <answer> tags: nothing parsed
    untagged = play("reasoning_gym:basic_arithmetic", task, task["answer"])
    assert untagged.reward == 0.0 and untagged.info["answer"] is None


def test_reasoning_gym_mix_samples_datasets_by_weight() -> None:
    config = {
        "size": 300,
        "test_size": 10,
        "datasets": {
            "basic_arithmetic": 3,
            "chain_sum": {"weight": 1, "config": {"min_terms": 2, "max_terms": 2}},
        },
    }
    env = make("reasoning_gym:mix", **config)
    names = [t["dataset"] for t in env.tasks("train")]
    assert set(names) == {"basic_arithmetic", "chain_sum"} and names.count("basic_arithmetic") > names.count(
        "chain_sum"
    )
    task = next(t for t in env.tasks("test") if t["dataset"] == "chain_sum")
    # scored by the sub-dataset's own verifier
    assert play("reasoning_gym:mix", task, f"<answer>{task['answer']}</answer>", config).reward == 1.0


def test_a_hanging_verifier_is_cut_by_the_episode_wall_clock(monkeypatch) -> None:
    from agentrl.env.adapters import reasoning_gym as rg

    env = make("reasoning_gym:basic_arithmetic")
    task = next(iter(env.tasks("test")))
    data = env._data("test")
    monkeypatch.setattr(data, "score_answer", lambda answer, entry: time.sleep(3600))
    assert rg._dataset.cache_info().currsize  # the patched dataset is the one the episode scores with
    t0 = time.monotonic()
    ep = play("reasoning_gym:basic_arithmetic", task, "<answer>1</answer>", episode_timeout_s=1.0)
    assert ep.truncated and ep.truncation == "timeout" and ep.error is None
    assert time.monotonic() - t0 < 60  # bounded: the serve loop got control back


def test_a_raising_verifier_fails_the_episode_as_an_environment_error(monkeypatch) -> None:
    env = make("reasoning_gym:basic_arithmetic")
    task = next(iter(env.tasks("test")))

    def broken(answer: Any, entry: Any) -> float:
        raise ZeroDivisionError("verifier bug")

    monkeypatch.setattr(env._data("test"), "score_answer", broken)
    ep = play("reasoning_gym:basic_arithmetic", task, "<answer>1</answer>")
    assert ep.error_kind == "environment" and "verifier bug" in ep.error


# -- TextArena -------------------------------------------------------------------------------------

def first_move(body: dict[str, Any]) -> str:
    import random

    from agentrl.env.adapters.textarena import random_move

    return random_move(body["messages"][-1]["content"], random.Random(len(body["messages"])))


def test_textarena_self_play_gives_each_players_calls_that_players_reward() -> None:
    client = ScriptedClient(first_move)
    task = next(iter(make("textarena:TicTacToe-v0").tasks("test")))
    ep = asyncio.run(run_episode(client, "textarena:TicTacToe-v0", task, group_id="g",
                                 limits=EpisodeLimits(max_turns=12, max_tokens=8, episode_timeout_s=120)))
    assert ep.error is None and ep.terminated, ep.error
    rewards = ep.info["rewards"]
    seats = [0 if "You are Player 0" in b["messages"][1]["content"] else 1 for b in client.bodies]
    assert seats[:2] == [0, 1]  # the players alternate, each in its own chat
    assert ep.sample_rewards == {i: rewards[str(s)] for i, s in enumerate(seats)}
    for body in client.bodies:  # a player's chat only grows: its calls chain into one sample
        assert body["messages"][0]["role"] == "system" and body["temperature"] == 1.0


def test_textarena_against_a_fixed_opponent_plays_the_seat_the_task_names() -> None:
    env = make("textarena:TicTacToe-v0", opponent="random")
    tasks = list(env.tasks("train"))[:2]
    assert [t["seat"] for t in tasks] == [0, 1]
    for task in tasks:
        client = ScriptedClient(first_move)
        ep = asyncio.run(run_episode(client, "textarena:TicTacToe-v0", task, group_id="g",
                                     env_config={"opponent": "random"}, limits=EpisodeLimits(max_turns=12)))
        assert ep.error is None and ep.terminated
        assert all(f"You are Player {task['seat']}" in b["messages"][1]["content"] for b in client.bodies)
        assert ep.reward == ep.info["rewards"][str(task["seat"])]


def test_a_game_that_raises_fails_the_episode_as_an_environment_error(monkeypatch) -> None:
    import textarena

    real_make = textarena.make

    def broken_make(*a: Any, **kw: Any) -> Any:
        game = real_make(*a, **kw)
        game.step = lambda action: (_ for _ in ()).throw(RuntimeError("game bug"))
        return game

    monkeypatch.setattr(textarena, "make", broken_make)
    task = next(iter(make("textarena:TicTacToe-v0").tasks("test")))
    ep = play("textarena:TicTacToe-v0", task, first_move)
    assert ep.error_kind == "environment" and "game bug" in ep.error


def test_the_turn_limit_truncates_a_game_it_would_not_let_finish() -> None:
    task = next(iter(make("textarena:TicTacToe-v0").tasks("test")))
    ep = play("textarena:TicTacToe-v0", task, first_move, max_turns=2)
    assert ep.truncated and ep.truncation == "max_turns" and ep.error is None and ep.turns == 2


# -- OpenEnv ---------------------------------------------------------------------------------------

def guess(low_high: list[int]) -> Any:
    def reply(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]["content"]
        if "higher" in last:
            low_high[0] = low_high[2] + 1
        elif "lower" in last:
            low_high[1] = low_high[2] - 1
        low_high[2] = (low_high[0] + low_high[1]) // 2
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{len(body['messages'])}", "type": "function",
             "function": {"name": "act", "arguments": json.dumps({"guess": low_high[2]})}}]}
    return reply


def test_an_openenv_environment_plays_over_its_own_client_with_typed_actions() -> None:
    env = make("openenv:number_guess")
    assert env.tool_schemas()[0]["function"]["parameters"]["properties"]["guess"]["type"] == "integer"
    task = next(iter(env.tasks("test")))
    ep = play("openenv:number_guess", task, guess([1, 20, 0]), max_turns=6)
    assert ep.error is None and ep.terminated and ep.reward == 1.0  # binary search finds it in five


def test_an_invalid_openenv_action_is_explained_to_the_model() -> None:
    task = next(iter(make("openenv:number_guess").tasks("test")))
    bad = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "act", "arguments": '{"guess": "ten"}'}}]}
    ep = play("openenv:number_guess", task, lambda body: bad, max_turns=2)
    assert ep.error is None and ep.truncated and ep.info["action_errors"] == 2


def test_an_openenv_server_that_fails_fails_the_episode_as_an_environment_error(monkeypatch) -> None:
    from agentrl.env.adapters import openenv as oe

    env_cls = lookup("openenv:number_guess")

    async def broken(self: Any, action: Any) -> Any:
        raise ConnectionError("server went away")

    monkeypatch.setattr(env_cls.spec["client"], "step", broken)
    task = next(iter(make("openenv:number_guess").tasks("test")))
    ep = play("openenv:number_guess", task, guess([1, 20, 0]))
    assert ep.error_kind == "environment" and "server went away" in ep.error
    assert oe._servers  # the server itself is still up for the next episode


# -- verifiers ---------------------------------------------------------------------------------------

def add(body: dict[str, Any]) -> str:
    import re

    question = next(m["content"] for m in body["messages"] if m["role"] == "user")
    a, b = map(int, re.findall(r"\d+", question))
    return str(a + b)


@pytest.mark.slow
def test_verifiers_scores_with_its_weighted_rubric_over_one_and_two_turns() -> None:
    for name, calls in (("verifiers:vf_arith", 1), ("verifiers:vf_arith_check", 2)):
        env = make(name, taskset_args={"num_tasks": 10})
        assert len(env.tasks("train")) == 8 and len(env.tasks("test")) == 2  # the last fifth is held out
        client = ScriptedClient(add)
        task = env.tasks("test")[0]
        ep = asyncio.run(
            run_episode(
                client,
                name,
                task,
                group_id="g",
                env_config={"taskset_args": {"num_tasks": 10}},
                limits=EpisodeLimits(max_turns=4, episode_timeout_s=600),
            )
        )
        assert ep.error is None and ep.terminated, ep.error
        assert ep.reward == pytest.approx(1.2)  # correct (weight 1.0) + concise (weight 0.2)
        assert ep.info["rewards"]["correct"] == {"score": 1.0, "weight": 1.0}
        assert len(client.bodies) == calls == ep.turns
        assert all(
            b["max_tokens"] <= 128 and b["temperature"] == 1.0 and "stream" not in b for b in client.bodies
        )
    wrong = asyncio.run(
        run_episode(
            ScriptedClient(lambda b: "I think it is 1000000"),
            "verifiers:vf_arith",
            task,
            group_id="g",
            env_config={"taskset_args": {"num_tasks": 10}},
            limits=EpisodeLimits(episode_timeout_s=600),
        )
    )
    assert wrong.reward == 0.0 and wrong.terminated



PORT_FILE_CHECK = """
import asyncio, importlib.util, os, sys, tempfile
spec = importlib.util.spec_from_file_location("_verifiers_worker", sys.argv[1])
_verifiers_worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_verifiers_worker)
from verifiers.v1.mcp import launch

class Local:
    type = "subprocess"
    async def read(self, path):
        with open(path, "rb") as f:
            return f.read()

class Broken(Local):
    async def read(self, path):
        raise asyncio.CancelledError

_verifiers_worker._port_files_removed()
fd, path = tempfile.mkstemp(prefix="vf-port-")
os.write(fd, b"4321"); os.close(fd)
assert asyncio.run(launch._read_back_port(Local(), path)) == 4321 and not os.path.exists(path)
fd, path = tempfile.mkstemp(prefix="vf-port-")
os.close(fd)
try:
    asyncio.run(launch._read_back_port(Broken(), path))
except asyncio.CancelledError:
    pass
assert not os.path.exists(path)
print("removed")
"""


def test_verifiers_tool_servers_port_files_are_removed_once_read() -> None:
    """verifiers' launcher leaves the /tmp/vf-port-* file a local tool server reports its port in;
    the worker removes it once read, and when the read is cancelled."""
    import subprocess

    from agentrl.env.adapters.verifiers import WORKER, interpreter

    python = interpreter()
    if python is None:
        pytest.skip("no Python with verifiers (.venv-verifiers)")
    out = subprocess.run([python, "-P", "-c", PORT_FILE_CHECK, str(WORKER)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "removed", out.stderr[-2000:]


# -- Harbor ------------------------------------------------------------------------------------------

@pytest.mark.docker
@pytest.mark.parametrize("name", ["hello-file", "count-lines", "fix-script"])
def test_a_shipped_harbor_task_is_solved_by_its_solution_and_not_without_it(name: str) -> None:
    from agentrl.sandbox import SandboxConfig
    from agentrl.sandbox.attach import attached, pool_for

    env_cls = lookup(f"harbor:{name}")
    task = env_cls().tasks("test")[0]

    async def body() -> tuple[float, float]:
        pool = await pool_for(env_cls.sandbox_image, SandboxConfig(backend="docker", warm=0, memory_mb=256),
                              f"t-harbor-{uuid.uuid4().hex[:6]}")
        try:
            scores = []
            for solve in (False, True):
                env = env_cls()
                async with attached(env, pool, task):
                    await env.reset(task)
                    if solve:
                        out = await env.bash((Path(task["folder"]) / "solution" / "solve.sh").read_text())
                        assert out.startswith("[exit code 0]"), out
                    scores.append(await env.run_tests(task))
            return scores[0], scores[1]
        finally:
            await pool.close()

    unsolved, solved = asyncio.run(body())
    assert solved == 1.0 and unsolved < 1.0


@pytest.mark.docker
def test_harbor_tests_that_write_no_reward_fail_the_episode_as_an_environment_error(tmp_path: Path) -> None:
    import shutil

    from agentrl.sandbox import SandboxConfig
    from agentrl.sandbox.attach import pool_for

    task_dir = tmp_path / "no-reward"
    shutil.copytree(ROOT / "tasks" / "harbor" / "hello-file", task_dir)
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\nexit 3\n")
    name = f"harbor:{task_dir}"
    env_cls = lookup(name)
    task = env_cls().tasks("test")[0]

    async def body() -> Any:
        pool = await pool_for(env_cls.sandbox_image, SandboxConfig(backend="docker", warm=0, memory_mb=256),
                              f"t-harbor-{uuid.uuid4().hex[:6]}")
        try:
            return await run_episode(
                ScriptedClient(lambda b: "done"),
                name,
                task,
                group_id="g",
                sandbox_pool=pool,
                limits=EpisodeLimits(episode_timeout_s=120),
            )
        finally:
            await pool.close()

    ep = asyncio.run(body())
    assert ep.error_kind == "environment" and "wrote no reward" in ep.error, ep.error
    agentrl.env.unregister(name)
