"""Arithmetic with a Python tool: the model computes in a sandbox, then answers with the number.

Tasks are small integer expressions ("What is 37 * 12 + 5?"). The ``python`` tool runs code in
the episode's sandbox (Docker by default) and returns its output. Reward 1.0 when the final
plain-text answer's last integer equals the value, else 0.0.
"""

from __future__ import annotations

import random
import re
from typing import Any

import agentrl
from environments.arithmetic.problems import arithmetic_problem, sized_problem

SYSTEM = "Use the python tool to compute the answer, then reply with the number."


@agentrl.environment("arithmetic")
class ArithmeticEnv(agentrl.ToolEnv):
    system_prompt = SYSTEM
    sandbox_image = "agentrl/base:bookworm"
    max_turns = 4

    def __init__(self, num_train: int = 10_000, num_test: int = 200, seed: int = 0,
                 digits: list[int] | None = None) -> None:
        """``digits``: mixed difficulty, each task's operands of one of these sizes (its ``digits``),
        drawn alike (e.g. [1, 2, 4, 8]: from trivial to beyond a small model's reach); None: the
        default problems (operands up to 99)."""
        super().__init__()
        if digits is not None and (not digits or any(not 1 <= d <= 30 for d in digits)):
            raise ValueError(f"digits must be a non-empty list of sizes from 1 to 30 (got {digits})")
        self.num_train, self.num_test, self.seed, self.digits = num_train, num_test, seed, digits

    def tasks(self, split: str = "train"):
        # Disjoint streams: test tasks come from a different seed than training tasks.
        rng = random.Random(f"{self.seed}-{split}")
        for i in range(self.num_train if split == "train" else self.num_test):
            if self.digits:
                size = rng.choice(self.digits)
                expr, value = sized_problem(rng, size)
                yield {"id": f"{split}-{i}", "question": f"What is {expr}?", "answer": value, "digits": size}
                continue
            expr, value = arithmetic_problem(rng)
            yield {"id": f"{split}-{i}", "question": f"What is {expr}?", "answer": value}

    @agentrl.tool
    async def python(self, code: str) -> str:
        """Run Python code in a sandbox and return what it prints.

        Args:
            code: Python source; use print() to show results.
        """
        assert self.sandbox is not None, "the arithmetic environment needs a sandbox"
        r = await self.sandbox.exec(["python3", "-c", code], timeout=10.0)
        if r.timed_out:
            return "Error: timed out"
        out = (r.stdout + r.stderr).strip()
        return out[-2000:] if out else "(no output)"

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        numbers = re.findall(r"-?\d+", answer)
        return 1.0 if numbers and int(numbers[-1]) == task["answer"] else 0.0
