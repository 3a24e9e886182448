"""verifiers' multi-agent environments as agentrl roles (#36, item 7): a verifiers ``Env`` that declares
several agents (``AgentConfig`` fields) declares them as roles, each agent's calls reach its role's
agent (its own router session, its binding's model), each role gets its agent's reward, and an agent
the env's ``setup`` marks untrainable is reported (and a binding that trains it warned about).

The two-agent env is written here (a verifiers taskset package on ``$AGENTRL_VERIFIERS_PATH``): a
solver answers vf_arith's question, then a checker, which its ``setup`` marks untrainable and whose
config pins a model of its own, says whether the answer is right. verifiers' built-in ``user-sim``
runs too (offline: its user rides verifiers' tool-less ``null`` harness). No engine: the chat client
answers by session.
"""

from __future__ import annotations

import asyncio
import logging
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from agentrl.env import make
from agentrl.env.adapters.verifiers import available
from agentrl.errors import ConfigError
from agentrl.rollout.config import EpisodeLimits, RoleBinding
from agentrl.rollout.episode import run_episode
from agentrl.router.sessions import SessionSummary

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not available(), reason="no Python with verifiers")]

PAIR = '''
"""Two agents on vf_arith's tasks: a solver answers, a checker (not trained) says whether it is right."""

import verifiers.v1 as vf
from vf_arith import ArithConfig, ArithData, ArithTask, ArithTaskset


class PairConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    checker: vf.AgentConfig = vf.AgentConfig(model="a-model-of-its-own")


class PairEnv(vf.Env[PairConfig]):
    async def setup(self, agents):
        agents.checker.trainable = False

    async def run(self, task, agents):
        solution = await agents.solver.run(task)
        asked, answered = task.data.prompt_text, solution.last_reply
        await agents.checker.run(vf.Task(vf.TaskData(
            idx=task.data.idx, prompt=f"Asked {asked!r}, someone answered {answered!r}. Right?")))


class PairTaskset(ArithTaskset):
    pass


__all__ = ["ArithConfig", "ArithData", "ArithTask", "PairConfig", "PairEnv", "PairTaskset"]
'''

NAME = "verifiers:vf_pair_roles"
CONFIG = {"taskset_args": {"num_tasks": 5}}


@pytest.fixture(autouse=True)
def pair_on_path(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path_factory.getbasetemp() / "vf_tasksets"
    (folder / "vf_pair_roles").mkdir(parents=True, exist_ok=True)
    (folder / "vf_pair_roles" / "__init__.py").write_text(textwrap.dedent(PAIR))
    monkeypatch.setenv("AGENTRL_VERIFIERS_PATH", str(folder))
    return folder


def last_user(body: dict[str, Any]) -> str:
    return next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user") or ""


class BySession:
    """A chat client that answers each call by ``reply(role, body)``, the role read off its router
    session (``<episode>.<role>``); it records (session, body) per call."""

    model_name = "m"

    def __init__(self, reply: Any) -> None:
        self.reply, self.bodies = reply, []

    async def begin(self, session_id: str, **meta: Any) -> None:
        pass

    async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
        self.bodies.append((session_id, body))
        content = self.reply(str(session_id).rsplit(".", 1)[-1], body)
        return {"id": f"c{len(self.bodies)}", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
                "agentrl": {"session_id": session_id, "call_index": len(self.bodies) - 1, "versions": [[0]]}}

    async def end(self, session_id: str) -> SessionSummary | None:
        return SessionSummary(session_id, [])


def pair_reply(role: str, body: dict[str, Any]) -> str:
    if role == "solver":
        a, b = map(int, re.findall(r"\d+", last_user(body)))
        return str(a + b)
    return "yes"


def play(name: str, config: dict[str, Any], reply: Any,
         roles: dict[str, RoleBinding]) -> tuple[Any, BySession]:
    client = BySession(reply)
    task = make(name, **config).tasks("test")[0]
    ep = asyncio.run(run_episode(client, name, task, group_id="g", env_config=config, roles=roles,
                                 limits=EpisodeLimits(max_turns=20, episode_timeout_s=600)))
    return ep, client


def test_a_multi_agent_verifiers_env_declares_its_agents_as_roles() -> None:
    env = make(NAME, **CONFIG)
    assert env.roles == ("solver", "checker") and env.untrainable == ("checker",)
    assert type(env).declared_roles(CONFIG) == ("solver", "checker")
    assert make("verifiers:vf_arith_check", **CONFIG).roles == ()  # one agent: the episode's policy


def test_each_agents_calls_reach_its_roles_agent_and_binding() -> None:
    ep, client = play(NAME, CONFIG, pair_reply, {"checker": RoleBinding(frozen=True)})
    assert ep.error is None, ep.error
    sessions = [s for s, _ in client.bodies]
    assert sessions == [f"{ep.episode_id}.solver", f"{ep.episode_id}.checker"]
    solver, checker = (b for _, b in client.bodies)
    assert "What is" in last_user(solver) and "model" not in solver  # the default policy
    assert checker["model"] == "base"  # the frozen binding's, not the verifiers config's own model
    assert "someone answered" in last_user(checker) and ep.info["untrainable"] == ["checker"]
    # each role gets its agent's reward; the episode's is the trained agents' (the solver's rubric)
    assert ep.info["role_rewards"] == {"solver": pytest.approx(1.2), "checker": 0.0}
    assert ep.reward == pytest.approx(1.2)
    assert ep.info["agents"]["checker"] == {"reward": 0.0, "traces": 1, "trainable": False}
    nodes = ep.info["graph"]["nodes"]
    assert [(n["role"], n["sampler"], n["trained"]) for n in nodes] == [
        ("solver", "policy:", True), ("checker", "frozen", False)]


def test_a_binding_that_trains_an_agent_verifiers_does_not_train_is_warned_about(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="agentrl.env.adapters.verifiers"):
        ep, client = play(NAME, CONFIG, pair_reply, {"solver": RoleBinding(policy="")})
    assert ep.error is None, ep.error
    assert [s for s, _ in client.bodies] == [f"{ep.episode_id}.solver", f"{ep.episode_id}.checker"]
    assert "marks agent 'checker' not trainable" in caplog.text and ep.info["untrainable"] == ["checker"]


def test_an_unknown_role_is_refused_at_start_with_the_envs_agents() -> None:
    from agentrl.serve.build import check_declared_roles
    from agentrl.serve.config import ServeConfig

    cfg = ServeConfig()
    cfg.env.name, cfg.env.config = NAME, dict(CONFIG)
    cfg.env.roles = {"checker": RoleBinding(frozen=True)}
    check_declared_roles(cfg)
    cfg.env.roles = {"judge": RoleBinding()}
    with pytest.raises(ConfigError, match=r"its roles: \['solver', 'checker'\]"):
        check_declared_roles(cfg)


def test_verifiers_built_in_user_sim_plays_its_assistant_and_user_as_roles() -> None:
    config = {**CONFIG, "env_args": {"id": "user-sim"}}
    env = make("verifiers:vf_arith", **config)
    assert env.roles == ("assistant", "user") and env.untrainable == ("user",)

    def reply(role: str, body: dict[str, Any]) -> str:
        if role == "user":  # states the scenario from its persona, then ends the conversation
            said = sum(m["role"] == "assistant" for m in body["messages"])
            system = body["messages"][0]["content"]
            return re.search(r"What is \d+ \+ \d+\?", system).group(0) if said == 0 else "###DONE###"
        a, b = map(int, re.findall(r"\d+", last_user(body)))
        return str(a + b)

    ep, client = play("verifiers:vf_arith", config, reply, {"user": RoleBinding(frozen=True)})
    assert ep.error is None, ep.error
    roles = [s.rsplit(".", 1)[-1] for s, _ in client.bodies]
    assert roles == ["user", "assistant", "user"]
    assert ep.reward == pytest.approx(1.2) and ep.info["role_rewards"]["assistant"] == pytest.approx(1.2)
    assert ep.info["untrainable"] == ["user"]
