"""Straggler: a multi-turn tool environment whose latencies are heavy-tailed, as real agent work is.

Each task asks the model to look up a few keys with the ``lookup`` tool, one call per turn, and
then give their sum. Two things make episode latencies range widely, which is what the async
pipeline is built for (``benchmarks/async_vs_sync.py``):

- every turn's environment step waits a log-normal time (the tool's latency: a slow API, a build,
  a test run); with the default ``latency_sigma`` of 1.3 the p99 is about 20x the median;
- the number of keys per task is heavy-tailed too (1 to ``max_keys``, P(k) proportional to
  k^-1.5), so some episodes take many more turns than others.

The episode lasts exactly one turn per key plus the answer, whatever the model writes, so the
workload is the same for any policy (give it ``env.max_turns`` of at least ``max_keys + 1``).
The reward is the fraction of lookup turns answered with a well-formed tool call, plus 1 for a
final reply that contains the right sum; it varies across a group even for a weak model, so
training has a signal. No sandbox: the tool only waits.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from typing import Any

import agentrl
from agentrl.env.tools import parse_tool_calls


def key_counts(max_keys: int, alpha: float = 1.5) -> tuple[list[int], list[float]]:
    ks = list(range(1, max_keys + 1))
    weights = [k ** -alpha for k in ks]
    return ks, weights


def set_workload(env: Any, latency_median_s: float, latency_sigma: float, max_keys: int, num_train: int,
                 num_test: int, seed: int) -> None:
    """The straggler workload's settings on ``env`` (checked), and its latency generator (this one and
    ``straggler_roles`` share them)."""
    if latency_median_s < 0 or latency_sigma < 0 or max_keys < 1:
        raise ValueError("latency_median_s and latency_sigma must be >= 0 and max_keys >= 1")
    env.latency_median_s, env.latency_sigma = latency_median_s, latency_sigma
    env.max_keys, env.num_train, env.num_test, env.seed = max_keys, num_train, num_test, seed
    env.rng = random.Random()


@agentrl.environment("straggler")
class StragglerEnv(agentrl.Environment):
    def __init__(self, latency_median_s: float = 0.25, latency_sigma: float = 1.3, max_keys: int = 8,
                 num_train: int = 10_000, num_test: int = 200, seed: int = 0) -> None:
        set_workload(self, latency_median_s, latency_sigma, max_keys, num_train, num_test, seed)
        self.task: dict[str, Any] = {}
        self.turns = 0
        self.good_calls = 0

    def tasks(self, split: str = "train"):
        rng = random.Random(f"{self.seed}-{split}")
        ks, weights = key_counts(self.max_keys)
        for i in range(self.num_train if split == "train" else self.num_test):
            n = rng.choices(ks, weights)[0]
            keys = [f"k{rng.randint(10, 99)}" for _ in range(n)]
            yield {"id": f"{split}-{i}", "keys": keys, "values": [rng.randint(1, 20) for _ in keys],
                   "latency_seed": rng.getrandbits(32)}

    def latency_s(self) -> float:
        """One tool call's latency: log-normal with the configured median and sigma."""
        return self.latency_median_s * math.exp(self.latency_sigma * self.rng.gauss(0.0, 1.0))

    async def reset(self, task: dict[str, Any]) -> agentrl.Reset:
        self.task, self.turns, self.good_calls = task, 0, 0
        self.rng = random.Random(task.get("latency_seed"))
        keys = ", ".join(task["keys"])
        return agentrl.Reset(
            messages=[
                {"role": "system", "content": "Look up each key with the lookup tool, one per turn, "
                                              "then reply with the sum of the values."},
                {"role": "user", "content": f"Keys: {keys}. What is the sum of their values?"},
            ],
            tools=[{"type": "function", "function": {
                "name": "lookup", "description": "The value stored under a key.",
                "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                               "required": ["key"]}}}],
        )

    async def step(self, message: dict[str, Any]) -> agentrl.StepResult:
        keys, values = self.task["keys"], self.task["values"]
        self.turns += 1
        info = {"keys": len(keys), "good_calls": self.good_calls}
        if self.turns > len(keys):  # every key looked up (or skipped): this reply is the answer
            numbers = re.findall(r"-?\d+", message.get("content") or "")
            solved = bool(numbers) and int(numbers[-1]) == sum(values)
            reward = self.good_calls / len(keys) + float(solved)
            return agentrl.StepResult(messages=[], reward=reward, terminated=True, info=info)
        calls = message.get("tool_calls") or parse_tool_calls(message.get("content") or "").tool_calls
        good = [c for c in calls if (c.get("function") or {}).get("name")]  # any well-formed call counts
        self.good_calls += bool(good)
        info["good_calls"] = self.good_calls
        await asyncio.sleep(self.latency_s())
        key, value = keys[self.turns - 1], values[self.turns - 1]
        if good:
            obs = [
                {"role": "tool", "tool_call_id": c.get("id", ""), "content": f"{key} = {value}"} for c in good
            ]
        else:
            obs = [{"role": "user", "content": f"Use the lookup tool. {key} = {value}"}]
        return agentrl.StepResult(messages=obs, info=info)
