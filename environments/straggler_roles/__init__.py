"""Straggler roles: the ``straggler`` workload played by three agents, each waiting on a slow tool.

An episode of a task (a few keys, each with a hidden value) goes planner, worker, reviewer:

- the **planner** writes a plan naming the keys to look up, then files it (a tool wait);
- the **worker** looks the keys up with the ``lookup`` tool, one call per turn, each followed by the
  tool's wait, then replies with the sum of the values;
- the **reviewer** re-checks the values (a tool wait), then says whether the worker's sum is right.

Every tool wait is log-normal, as in ``straggler``: with the default ``latency_sigma`` of 1.3 the p99
is about 20x the median, and the number of keys per task is heavy-tailed (1 to ``max_keys``), so
episode latencies range widely (``benchmarks/multi_agent_stragglers.py``). An episode makes exactly
``keys + 3`` model calls whatever the model writes (give it ``env.max_turns`` of at least
``max_keys + 3``), so the workload is the same for any policy. Every wait is in ``info["tool_s"]``
and each role's total in ``info["role_tool_s"]``.

Rewards per role, each verifiable and graded so that it varies across a group even for a weak
model (the tiny benchmark model rarely writes a well-formed call or the exact sum): the planner's
is the fraction of the task's keys whose number its plan names; the worker's the fraction of lookup
turns answered with a well-formed tool call, plus how close its final reply's last number is to the
sum (``1 / (1 + |error|)``, 1 when exact); the reviewer, asked for the correct sum, gets the same
closeness for its own last number. The episode's (team) reward is the worker's. No sandbox: the
tools only wait.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import Iterator, Mapping
from typing import Any

import agentrl
from agentrl.env.roles import Agent
from agentrl.env.tools import parse_tool_calls
from environments.straggler import key_counts, set_workload

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The value stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}


def reply(out: dict[str, Any]) -> dict[str, Any]:
    """The assistant message of a chat response, as it goes back into the next call's messages."""
    message = out["choices"][0]["message"]
    kept = {k: message[k] for k in ("role", "content", "tool_calls") if message.get(k) is not None}
    kept.setdefault("content", "")
    return kept


def last_number(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def closeness(text: str, target: int) -> float:
    """How close the last number of ``text`` is to ``target``: 1 when equal, 0 without a number."""
    n = last_number(text)
    return 0.0 if n is None else 1.0 / (1.0 + abs(n - target))


@agentrl.environment("straggler_roles")
class StragglerRolesEnv(agentrl.MultiAgentEnv):
    roles = ("planner", "worker", "reviewer")

    def __init__(self, latency_median_s: float = 0.25, latency_sigma: float = 1.3, max_keys: int = 8,
                 num_train: int = 10_000, num_test: int = 200, seed: int = 0) -> None:
        set_workload(self, latency_median_s, latency_sigma, max_keys, num_train, num_test, seed)
        self.waits: list[tuple[str, float]] = []  # (role, seconds) of each tool call this episode

    def tasks(self, split: str = "train") -> Iterator[dict[str, Any]]:
        rng = random.Random(f"{self.seed}-roles-{split}")
        ks, weights = key_counts(self.max_keys)
        for i in range(self.num_train if split == "train" else self.num_test):
            keys = [f"k{rng.randint(10, 99)}" for _ in range(rng.choices(ks, weights)[0])]
            yield {"id": f"{split}-{i}", "keys": keys, "values": [rng.randint(1, 20) for _ in keys],
                   "latency_seed": rng.getrandbits(32)}

    def drawn_waits(self, task: dict[str, Any]) -> list[float]:
        """The tool waits an episode of ``task`` makes, in order (the planner's, one per key, the
        reviewer's): log-normal with the configured median and sigma, drawn from the task's seed, so
        a benchmark can count the waits of episodes a run cut off too."""
        rng = random.Random(task.get("latency_seed"))
        return [self.latency_median_s * math.exp(self.latency_sigma * rng.gauss(0.0, 1.0))
                for _ in range(len(task["keys"]) + 2)]

    async def tool(self, role: str) -> None:
        """The episode's next tool wait."""
        seconds = self.drawn[len(self.waits)]
        self.waits.append((role, seconds))
        await asyncio.sleep(seconds)

    async def reset(self, task: dict[str, Any]) -> agentrl.Reset:
        self.drawn, self.waits = self.drawn_waits(task), []
        return agentrl.Reset(messages=self.planner_messages(task))

    def planner_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "You plan lookups: name each key to look up, one per line."},
                {"role": "user", "content": f"Keys: {', '.join(task['keys'])}. Write the plan."}]

    async def play_roles(self, task: dict[str, Any], agents: Mapping[str, Agent]) -> agentrl.Played:
        keys, values = task["keys"], task["values"]
        plan = reply(await agents["planner"].chat({"messages": self.planner_messages(task)}))["content"]
        await self.tool("planner")  # filing the plan
        planned = sum(k[1:] in plan for k in keys) / len(keys)  # "k28": its number, 28, in the plan

        worker, good_calls = agents["worker"], 0
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "Look up each key with the lookup tool, one per turn, "
                                          "then reply with the sum of the values."},
            {"role": "user", "content": f"Plan: {plan[:400]}\nKeys: {', '.join(keys)}. What is their sum?"}]
        for key, value in zip(keys, values, strict=True):
            message = reply(await worker.chat({"messages": messages, "tools": [LOOKUP]}))
            calls = message.get("tool_calls") or parse_tool_calls(message["content"]).tool_calls
            good = [c for c in calls if (c.get("function") or {}).get("name")]
            good_calls += bool(good)
            await self.tool("worker")
            messages.append(message)
            found = f"{key} = {value}"
            messages += ([{"role": "tool", "tool_call_id": c.get("id", ""), "content": found} for c in good]
                         or [{"role": "user", "content": f"Use the lookup tool. {found}"}])
        answer = reply(await worker.chat({"messages": messages, "tools": [LOOKUP]}))["content"]
        total = sum(values)

        await self.tool("reviewer")  # looking the values up again
        facts = ", ".join(f"{k} = {v}" for k, v in zip(keys, values, strict=True))
        review = reply(await agents["reviewer"].chat({"messages": [
            {"role": "user", "content": f"Values: {facts}. The worker answered: {answer[:300]!r}. "
                                        "Check it: reply with the correct sum."}]}))["content"]
        rewards = {"planner": planned, "worker": good_calls / len(keys) + closeness(answer, total),
                   "reviewer": closeness(review, total)}
        role_tool_s = {r: round(sum(s for role, s in self.waits if role == r), 3) for r in self.roles}
        info = {"keys": len(keys), "solved": last_number(answer) == total,
                "tool_s": [round(s, 4) for _, s in self.waits], "role_tool_s": role_tool_s}
        return agentrl.Played(reward=rewards["worker"], role_rewards=rewards, info=info)
