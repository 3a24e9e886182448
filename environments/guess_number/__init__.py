"""Guess the number: a multi-turn game with feedback, no tools and no sandbox.

The environment picks a secret integer in [low, high] from the task's seed; the model replies
with a guess each turn and hears "higher", "lower" or "correct". Rewards per turn and per episode:
a reply without a number costs 0.1 on that turn; a correct guess ends the episode with
``1 - 0.1 * (wasted guesses)`` (at least 0.1), where wasted guesses are those beyond the
binary-search optimum. Running out of turns truncates the episode with no final reward.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

import agentrl


@agentrl.environment("guess_number")
class GuessNumberEnv(agentrl.Environment):
    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 10, num_train: int = 10_000,
                 num_test: int = 100) -> None:
        self.low, self.high, self.max_turns = low, high, max_turns
        self.num_train, self.num_test = num_train, num_test
        self.optimum = math.ceil(math.log2(high - low + 1))

    def tasks(self, split: str = "train"):
        offset, n = (0, self.num_train) if split == "train" else (1 << 30, self.num_test)
        for i in range(n):
            seed = offset + i
            yield {
                "id": f"{split}-{i}",
                "seed": seed,
                "secret": random.Random(seed).randint(self.low, self.high),
            }

    async def reset(self, task: dict[str, Any]) -> agentrl.Reset:
        self.secret, self.guesses, self.turns = int(task["secret"]), 0, 0
        return agentrl.Reset(messages=[
            {"role": "system", "content": "Guess the secret number. Reply with one integer per turn."},
            {"role": "user", "content": f"I picked an integer from {self.low} to {self.high}. Your guess?"},
        ])

    async def step(self, message: dict[str, Any]) -> agentrl.StepResult:
        self.turns += 1
        numbers = re.findall(r"-?\d+", message.get("content") or "")
        info = {"guesses": self.guesses, "secret": self.secret}
        if not numbers:
            return self._next("Please reply with an integer.", reward=-0.1, info=info)
        guess = int(numbers[-1])
        self.guesses += 1
        info["guesses"] = self.guesses
        if guess == self.secret:
            wasted = max(0, self.guesses - self.optimum)
            return agentrl.StepResult(messages=[{"role": "user", "content": "Correct!"}],
                                      reward=max(0.1, 1.0 - 0.1 * wasted), terminated=True, info=info)
        return self._next("Higher." if guess < self.secret else "Lower.", reward=0.0, info=info)

    def _next(self, text: str, reward: float, info: dict[str, Any]) -> agentrl.StepResult:
        truncated = self.turns >= self.max_turns
        return agentrl.StepResult(messages=[{"role": "user", "content": text}], reward=reward,
                                  truncated=truncated, info=info)
