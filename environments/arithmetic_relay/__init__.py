"""Arithmetic relay: two agents split a two-part sum, each agent its own policy if the run says so.

A task is two small integer expressions A and B; the relay's answer is A + B. The ``first`` agent
computes A with the ``python`` tool (the arithmetic environment's task, tool and reward), then the
``second`` computes B the same way; the team's sum is the first's number plus the second's. Each
role is scored on its own part (so one agent's mistake does not fail the other), the episode's
team reward is 1.0 when the sum is right, and ``info["role_success"]`` holds each role's
exact-answer success, which ``agentrl eval`` and ``agentrl run``'s held-out evaluation report per
role. Both agents use the episode's one sandbox.

Bound to two LoRA policies (``benchmarks/multi_agent.py``)::

    agentrl run --serve.env.name=arithmetic_relay --learn.lora.rank=8 \\
        --serve.policies.first={} --serve.policies.second={} \\
        --serve.env.roles.first.policy=first --serve.env.roles.second.policy=second
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Mapping
from typing import Any

import agentrl
from agentrl.env.base import Played, Reset
from agentrl.env.roles import ROLE_SUCCESS_KEY, Agent, tool_agent
from environments.arithmetic import ArithmeticEnv
from environments.arithmetic.problems import arithmetic_problem


def _last_int(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


@agentrl.environment("arithmetic_relay")
class ArithmeticRelay(agentrl.MultiAgentEnv):
    roles = ("first", "second")
    sandbox_image = ArithmeticEnv.sandbox_image

    def __init__(self, num_train: int = 10_000, num_test: int = 200, seed: int = 0,
                 max_turns: int = 2) -> None:
        self.num_train, self.num_test, self.seed = num_train, num_test, seed
        self.max_turns = max_turns  # each agent's: a tool call, then the answer

    def tasks(self, split: str = "train") -> Iterator[dict[str, Any]]:
        rng = random.Random(f"relay-{self.seed}-{split}")  # disjoint train and test streams
        for i in range(self.num_train if split == "train" else self.num_test):
            (a, va), (b, vb) = arithmetic_problem(rng), arithmetic_problem(rng)
            yield {"id": f"{split}-{i}", "parts": {"first": {"question": f"What is {a}?", "answer": va},
                                                   "second": {"question": f"What is {b}?", "answer": vb}},
                   "answer": va + vb}

    def _tool_env(self) -> ArithmeticEnv:
        env = ArithmeticEnv()
        env.max_turns, env.sandbox = self.max_turns, self.sandbox  # the episode's one sandbox
        return env

    async def reset(self, task: dict[str, Any]) -> Reset:
        return await self._tool_env().reset(task["parts"]["first"])  # what the first agent sees

    async def play_roles(self, task: dict[str, Any], agents: Mapping[str, Agent]) -> Played:
        wins, numbers = {}, {}
        for role in self.roles:
            result, answer = await tool_agent(agents[role], self._tool_env(), task["parts"][role])
            wins[role] = result.terminated and result.reward == 1.0
            numbers[role] = _last_int(answer) if result.terminated else None
        total = None if None in numbers.values() else sum(numbers.values())
        team = total == task["answer"]
        return Played(reward=float(team), role_rewards={role: float(won) for role, won in wins.items()},
                      info={ROLE_SUCCESS_KEY: wins, "success": team, "sum": total})
