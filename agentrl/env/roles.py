"""Multi-agent episodes: an environment's roles, each played by its own agent.

A :class:`MultiAgentEnv` declares its ``roles`` and plays each episode in ``play_roles`` with one
:class:`Agent` per role, in any orchestration: turn-based (one role after another, each given what
the others said), concurrent (``asyncio.gather`` over agents), or nested (``agent.fork()`` starts a
sub-agent whose calls hang off the forking call; ``agent.compact()`` makes the agent's next call a
new context that replaces its old one, say a summary). It returns a :class:`~agentrl.env.base.Played`
with ``role_rewards``.

What plays a role is the run's config, never the environment's: ``env.roles.<role>`` binds it to the
default policy (trained together with every role bound to it), a named LoRA policy (trained on that
role's samples alone), the frozen base model, or an external OpenAI-compatible endpoint (never
trained). Every call of every role is a node of the episode graph (:mod:`agentrl.rollout.roles`);
a trained role's samples are its own calls' chains, each tagged with its role and graph nodes.

Invariants: an agent's ``model`` field is not the environment's to set (the binding picks it); a
role's calls never share a sample with another role's; rewards for a role the environment does not
declare fail the episode as an environment error.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, Protocol

from agentrl.env.base import Model, Played, PlayingEnv, StepResult, ToolEnv
from agentrl.errors import EnvironmentFailure

__all__ = ["ROLE_NAME", "ROLE_SUCCESS_KEY", "Agent", "MultiAgentEnv", "check_roles", "take_turns",
           "tool_agent"]

#: The ``info`` key of a multi-agent episode whose environment declares each role's success (a dict
#: role -> bool): ``agentrl eval`` (and ``agentrl run``'s held-out evaluation) reports it per role.
ROLE_SUCCESS_KEY = "role_success"

#: a role's name: it names a router session (``<episode>.<role>``) and a config key
ROLE_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


class Agent(Model, Protocol):
    """One agent of a multi-agent episode: a :class:`~agentrl.env.base.Model` whose calls are its
    role's (recorded, graphed, limited by the episode's budgets, shared by all its agents)."""

    role: str
    trained: bool  # whether this role's calls train a policy (False: frozen or an external endpoint)

    def fork(self, role: str | None = None) -> Agent:
        """A sub-agent (of ``role``, default this agent's own): its first call hangs off this agent's
        latest call in the episode graph (a ``fork`` edge)."""
        ...

    def compact(self) -> None:
        """Mark a compaction: this agent's next call starts a new context (its messages replace the
        old ones, say with a summary) and a new sample, joined to the old by a ``compaction`` edge."""
        ...


def check_roles(env_name: str, roles: tuple[str, ...]) -> None:
    """A declared role list a run can bind: valid names, no repeats. ConfigError-free: raises ValueError."""
    bad = [r for r in roles if not isinstance(r, str) or not ROLE_NAME.fullmatch(r)]
    if bad or not roles or len(set(roles)) != len(roles):
        raise ValueError(f"environment {env_name!r} declares roles {roles!r}: give one or more distinct "
                         "names, each a lowercase letter then up to 39 lowercase letters, digits or '_'")


class MultiAgentEnv(PlayingEnv):
    """An environment whose episodes several agents play, one per role (override ``play_roles``)."""

    #: the roles an episode has, e.g. ("proposer", "solver")
    roles: tuple[str, ...] = ()

    @classmethod
    def declared_roles(cls, config: Mapping[str, Any]) -> tuple[str, ...]:
        """The roles an instance built with ``config`` declares, known before one is built (the run's
        bindings are checked against them at start). Override when the config picks the roles."""
        return tuple(cls.roles)

    @abstractmethod
    async def play_roles(self, task: dict[str, Any], agents: Mapping[str, Agent]) -> Played:
        """Play one episode of ``task`` (``reset`` was called with it) with ``agents[role]`` for each
        role, and score it (``Played.role_rewards``)."""

    async def play(self, task: dict[str, Any], model: Model) -> Played:
        agents = getattr(model, "agents", None)
        if agents is None:
            raise EnvironmentFailure(f"{type(self).__name__} is a multi-agent environment: it plays with one "
                                     "agent per role, which this runner does not give")
        played = await self.play_roles(task, agents(self.roles))
        under_way = model.calls_under_way() if hasattr(model, "calls_under_way") else 0
        if under_way:
            raise EnvironmentFailure(f"play_roles returned with {under_way} agent call(s) still under way: a "
                                     "fork whose branch was never awaited (await every sub-agent before "
                                     "returning)")
        unknown = sorted(set(getattr(played, "role_rewards", None) or {}) - set(self.roles))
        if unknown:
            raise EnvironmentFailure(f"play_roles returned rewards for roles {unknown} it does not declare "
                                     f"(its roles: {list(self.roles)})")
        return played


async def tool_agent(agent: Agent, env: ToolEnv, task: dict[str, Any]) -> tuple[StepResult, str]:
    """Let ``agent`` play ``task`` of a :class:`~agentrl.env.base.ToolEnv` (a role that acts through
    tools): the environment's opening and tools, then model call, tool results, ... until it answers
    without a tool call (scored by the environment) or reaches the environment's ``max_turns``.
    Returns the last step's result and the agent's final text. The environment's sandbox, if it
    needs one, is the caller's to attach (a multi-agent environment shares its own)."""
    opening = await env.reset(task)
    messages = list(opening.messages)
    body: dict[str, Any] = {"tools": opening.tools} if opening.tools else {}
    while True:
        out = await agent.chat(dict(body, messages=messages))
        reply = out["choices"][0]["message"]
        message = {k: reply[k] for k in ("role", "content", "tool_calls") if reply.get(k) is not None}
        message.setdefault("content", "")
        messages.append(message)
        result = await env.step(message)
        messages.extend(result.messages)
        if result.terminated or result.truncated:
            return result, str(message.get("content") or "")


async def take_turns(agents: Mapping[str, Agent], order: list[str],
                     openings: Mapping[str, list[dict[str, Any]]], rounds: int,
                     body: Mapping[str, Any] | None = None) -> list[tuple[str, str]]:
    """Turn-based play: the roles of ``order`` speak one after another for ``rounds`` rounds, each in
    its own conversation (``openings[role]``: its system and first messages), and each hears what the
    others said since its last turn as one user message (``[role] text`` per line). Every role's
    conversation grows by its own replies (so its calls stitch into one sample per role). ``body``:
    more of each call's request (``max_tokens``, ...). Returns the transcript, ``(role, text)`` per turn.
    """
    chats = {role: list(openings.get(role) or []) for role in order}
    heard: dict[str, list[str]] = {role: [] for role in order}
    transcript: list[tuple[str, str]] = []
    for _ in range(rounds):
        for role in order:
            messages = chats[role]
            if heard[role]:
                messages.append({"role": "user", "content": "\n".join(heard[role])})
                heard[role] = []
            if not messages or messages[-1].get("role") == "assistant":
                raise ValueError(f"role {role!r} has nothing to answer: give it an opening (a user message)")
            out = await agents[role].chat({**(body or {}), "messages": list(messages)})
            text = str(out["choices"][0]["message"].get("content") or "")
            messages.append({"role": "assistant", "content": text})
            transcript.append((role, text))
            for other in order:
                if other != role:
                    heard[other].append(f"[{role}] {text}")
    return transcript
