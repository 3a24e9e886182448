"""`agentrl envs list | show | try` on environments written outside agentrl: a verifiers taskset and a
TextArena game that each test writes to its own folder (on ``$AGENTRL_VERIFIERS_PATH``, or imported
with ``--import``), never the shipped ones. ``try`` runs against the session's real vLLM engine."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import agentrl
from agentrl.env import make
from agentrl.env.cli import list_envs, show_env
from agentrl.rollout.tryout import try_episode

VF_ECHO = '''"""Say a word back: a one-turn verifiers taskset written by the test."""

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def said(self, task: EchoData, trace: vf.Trace) -> float:
        return 1.0 if task.word in (trace.last_reply or "") else 0.0


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 5


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        words = ["apple", "pear", "plum", "fig", "lime"]
        return [EchoTask(EchoData(id=f"echo-{i}", prompt=f"Say {words[i]}.", word=words[i]), self.config.task)
                for i in range(self.config.num_tasks)]


__all__ = ["EchoTaskset"]
'''

VF_TOOLS = '''"""Shout a word through a tool: a verifiers taskset with a tool server, written by the test."""

import verifiers.v1 as vf


class WordsToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "words"

    @vf.tool
    def shout(self, text: str, times: int = 1) -> str:
        """Return the text in capitals, repeated."""
        return " ".join([text.upper()] * times)


class ShoutConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ShoutData(vf.TaskData):
    word: str


class ShoutTask(vf.Task[ShoutData, vf.State, ShoutConfig]):
    @classmethod
    def toolsets(cls, config: ShoutConfig) -> list[vf.Toolset]:
        return [WordsToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def shouted(self, task: ShoutData, trace: vf.Trace) -> float:
        return 1.0 if task.word.upper() in (trace.last_reply or "") else 0.0


class ShoutTasksetConfig(vf.TasksetConfig):
    task: ShoutConfig = ShoutConfig()


class ShoutTaskset(vf.Taskset[ShoutTask, ShoutTasksetConfig]):
    def load(self):
        return [ShoutTask(ShoutData(id=f"shout-{w}", prompt=f"Shout {w}.", word=w), self.config.task)
                for w in ("oak", "elm", "ash", "yew", "fir")]


__all__ = ["ShoutTaskset"]


if __name__ == "__main__":  # verifiers starts a tool server as `python -m <its module>`
    WordsToolset.run()
'''

VF_BROKEN = '''"""A verifiers taskset whose tasks cannot be loaded."""

import verifiers.v1 as vf


class BrokenTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        raise RuntimeError("the word list is missing")


__all__ = ["BrokenTaskset"]
'''

TA_GAMES = '''"""High Card, a two-player TextArena game written by the test, and a game whose reset raises."""

import re

import textarena as ta
from textarena.envs import DEFAULT_WRAPPERS
from textarena.envs.registration import register


class HighCard(ta.Env):
    def __init__(self, broken: bool = False):
        self.broken = broken

    def reset(self, num_players, seed=None):
        if self.broken:
            raise RuntimeError("the deck is missing")
        self.state = ta.TwoPlayerState(num_players=num_players, seed=seed)
        self.state.reset(game_state={"picks": {}}, player_prompt_function=self._prompt)

    def _prompt(self, player_id, game_state):
        return (f"You are Player {player_id} in High Card. Name a number from 1 to 9 in brackets. "
                "Available moves: '[1]', '[5]', '[9]'. The higher number wins.")

    def step(self, action):
        player = self.state.current_player_id
        self.state.add_observation(from_id=player, to_id=-1, message=action,
                                   observation_type=ta.ObservationType.PLAYER_ACTION)
        found = re.search(r"\\[(\\d)\\]", action)
        picks = self.state.game_state["picks"]
        picks[player] = int(found.group(1)) if found else 0
        if len(picks) == 2:
            if picks[0] == picks[1]:
                self.state.set_draw(reason="the same number")
            else:
                self.state.set_winner(player_id=max(picks, key=picks.get), reason="the higher number")
        return self.state.step()


register("HighCard-TAG-v0", entry_point=HighCard, default_wrappers=DEFAULT_WRAPPERS)
register("BrokenCard-TAG-v0", entry_point=HighCard, default_wrappers=DEFAULT_WRAPPERS, broken=True)
'''


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "agentrl.cli", "envs", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture
def tasksets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The verifiers tasksets above in a folder on ``$AGENTRL_VERIFIERS_PATH``, under names of this test
    (the adapter lists each taskset once per process), with a helper module that is not a taskset."""
    folder = tmp_path / "tasksets"
    folder.mkdir()
    tag = uuid.uuid4().hex[:6]
    names = {kind: f"vf_{kind}_{tag}" for kind in ("echo", "tools", "broken")}
    for kind, text in (("echo", VF_ECHO), ("tools", VF_TOOLS), ("broken", VF_BROKEN)):
        (folder / f"{names[kind]}.py").write_text(text)
    (folder / "helpers.py").write_text('"""Not a taskset."""\nimport json\n')
    monkeypatch.setenv("AGENTRL_VERIFIERS_PATH", str(folder))
    yield {**names, "folder": str(folder)}
    for name in names.values():
        agentrl.env.unregister(f"verifiers:{name}")


@pytest.fixture
def games(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The TextArena games above, in a module of this test: its file and the games' names."""
    tag = uuid.uuid4().hex[:6]
    path = tmp_path / f"high_card_{tag}.py"
    path.write_text(TA_GAMES.replace("TAG", tag))
    yield {"file": str(path), "game": f"textarena:HighCard-{tag}-v0",
           "broken": f"textarena:BrokenCard-{tag}-v0"}
    agentrl.env.unregister(f"textarena:HighCard-{tag}-v0")
    agentrl.env.unregister(f"textarena:BrokenCard-{tag}-v0")


# -- list, show ------------------------------------------------------------------------------------

def test_envs_list_shows_the_verifiers_tasksets_found_on_agentrl_verifiers_path(
        tasksets: dict[str, str]) -> None:
    lines: list[str] = []
    assert list_envs(lines.append) == 0
    text = "".join(lines)
    section = text[text.index("[verifiers]"):]
    echo = next(line for line in section.splitlines() if line.startswith(f"verifiers:{tasksets['echo']} "))
    assert "Say a word back: a one-turn verifiers taskset written by the test." in echo
    assert tasksets["folder"] in echo
    assert f"verifiers:{tasksets['tools']}" in section and "verifiers:vf_arith " in section
    assert "verifiers:helpers" not in section  # a module there that does not import verifiers


@pytest.mark.slow
def test_envs_show_of_a_verifiers_tool_environment_shows_the_tools_its_agent_is_offered(
        tasksets: dict[str, str]) -> None:
    chunks: list[str] = []
    assert show_env(f"verifiers:{tasksets['tools']}", chunks.append) == 0
    info = json.loads("".join(chunks))
    assert info["about"].startswith("Shout a word through a tool")
    assert info["messages"][-1]["content"] == info["example_task"]["prompt"]
    [tool] = info["tools"]
    assert tool["type"] == "function"
    assert tool["function"]["name"] == "words_shout"  # <server>_<tool>, as verifiers names it
    assert tool["function"]["description"] == "Return the text in capitals, repeated."
    params = tool["function"]["parameters"]
    assert set(params["properties"]) == {"text", "times"} and params["required"] == ["text"]
    chunks.clear()
    assert show_env(f"verifiers:{tasksets['echo']}", chunks.append) == 0
    assert json.loads("".join(chunks))["tools"] == []  # a taskset without tool servers offers none


@pytest.mark.slow
def test_the_tools_envs_show_gives_are_those_verifiers_agent_offers_the_model(
        tasksets: dict[str, str]) -> None:
    from agentrl.rollout.episode import EpisodeLimits, run_episode
    from tests.test_env_adapters import ScriptedClient

    name = f"verifiers:{tasksets['tools']}"
    env = make(name)
    task = env.tasks("test")[0]
    shown = asyncio.run(env.reset(task)).tools
    call = {"id": "c1", "type": "function",
            "function": {"name": "words_shout", "arguments": json.dumps({"text": "fir", "times": 2})}}
    client = ScriptedClient(lambda body: {"role": "assistant", "content": "", "tool_calls": [call]}
                            if len(body["messages"]) == 1 else "FIR FIR")
    limits = EpisodeLimits(episode_timeout_s=600)
    port_files = set(Path("/tmp").glob("vf-port-*"))
    ep = asyncio.run(run_episode(client, name, task, group_id="g", limits=limits))
    assert ep.error is None and ep.reward == 1.0 and ep.info["tools"] == 1, ep.error
    assert set(Path("/tmp").glob("vf-port-*")) <= port_files  # the tool server's port file is gone
    assert [b["tools"] for b in client.bodies] == [shown, shown]  # verifiers' agent offered exactly these
    assert client.bodies[1]["messages"][-1]["content"] == "FIR FIR"  # and ran the tool it was called with


def test_an_unknown_verifiers_name_is_one_line_saying_where_it_looked(tasksets: dict[str, str]) -> None:
    for action in ("show", "try"):
        extra = ["--endpoint", "http://127.0.0.1:9/v1"] if action == "try" else []
        out = cli(action, "verifiers:no_such_taskset", *extra)
        assert out.returncode != 0 and out.stdout == ""
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "verifiers has no taskset 'no_such_taskset'" in out.stderr
        assert f"$AGENTRL_VERIFIERS_PATH ({tasksets['folder']})" in out.stderr
        assert "built-in tasksets (" in out.stderr and "tasks/verifiers/" in out.stderr


@pytest.mark.slow
def test_envs_show_of_an_environment_whose_tasks_or_reset_fail_shows_the_error_and_fails(
        tasksets: dict[str, str], games: dict[str, str]) -> None:
    broken = cli("show", games["broken"], "--import", games["file"])
    assert broken.returncode == 1 and "Traceback" not in broken.stderr, broken.stderr
    info = json.loads(broken.stdout)
    assert info["error"] == "reset raised RuntimeError: the deck is missing" and "messages" not in info
    working = cli("show", games["game"], "--import", games["file"])
    assert working.returncode == 0, working.stderr
    assert "You are Player 0 in High Card" in json.loads(working.stdout)["messages"][-1]["content"]
    chunks: list[str] = []
    assert show_env(f"verifiers:{tasksets['broken']}", chunks.append) == 1
    info = json.loads("".join(chunks))
    assert info["error"].startswith("tasks raised AdapterError: verifiers could not load")
    assert "the word list is missing" in info["error"]


# -- try, against the real engine ------------------------------------------------------------------

@pytest.mark.vllm
@pytest.mark.slow
def test_envs_try_plays_a_verifiers_environment_through_the_rollouts_path(vllm_engine: Any,
                                                                          tasksets: dict[str, str]) -> None:
    name = f"verifiers:{tasksets['echo']}"
    task = make(name).tasks("test")[0]
    lines: list[str] = []
    summary = asyncio.run(try_episode(name, f"{vllm_engine.url}/v1", max_turns=2, max_tokens=8,
                                      out=lines.append))
    text = "".join(lines)
    assert summary["error"] is None and summary["ended"] == "terminated", text
    assert summary["turns"] == 1 and summary["task_id"] == task["id"]
    assert text.startswith(f"== {name} | task {task['id']} | model tiny-tools | tools: none\n"
                           f"[user] {task['prompt']}\n")
    assert "\n-- turn 1 (" in text and "[assistant] " in text
    assert summary["info"]["rewards"] == {"said": {"score": summary["reward"], "weight": 1.0}}  # its rubric
    assert text.rstrip().endswith(f"== terminated after 1 turn(s), total reward {summary['reward']:.3f}")


@pytest.mark.vllm
def test_envs_try_plays_a_textarena_game_and_prints_both_players_turns(vllm_engine: Any,
                                                                       games: dict[str, str]) -> None:
    out = cli("try", games["game"], "--import", games["file"], "--endpoint", f"{vllm_engine.url}/v1",
              "--max-turns", "4", "--max-tokens", "8")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    text = out.stdout
    assert text.startswith(f"== {games['game']} | task test-0 | model tiny-tools | tools: none\n[system] ")
    assert text.count("You are Player 0 in High Card") == 1  # the opening, not printed again at its call
    assert text.count("You are Player 1 in High Card") == 1  # the second player's chat, before its call
    assert "\n-- turn 1 (" in text and "\n-- turn 2 (" in text and "\n-- turn 3 (" not in text
    assert '"seats": [0, 1]' in text
    assert text.rstrip().endswith("== terminated after 2 turn(s), total reward 0.000")
    cut = cli("try", games["game"], "--import", games["file"], "--endpoint", f"{vllm_engine.url}/v1",
              "--max-turns", "1", "--max-tokens", "8")
    assert cut.returncode == 0, cut.stdout + cut.stderr
    assert "== truncated (max_turns) after 1 turn(s)" in cut.stdout
