"""Coding: write a Python function; the reward is the fraction of its unit tests that pass.

Each task names a function, describes it and carries assert-style tests. The model may try code
with the ``run_python`` tool, then answers with the function (a fenced ``python`` block, or bare
code). Scoring runs the answer and each test separately in the episode's Docker sandbox (so a
crash, a hang or a hostile answer costs only that episode) and never shows the tests to the model.
Tasks come from the built-in list or any task source (``CodingEnv(tasks="my_tasks.jsonl")``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import agentrl

SYSTEM = ("Write the Python function the user asks for. You may test code with the run_python tool. "
          "Reply with the final function in a ```python block.")
TASKS = [
    {"id": "add", "name": "add", "spec": "add(a, b) returns the sum of two numbers",
     "tests": ["add(2, 3) == 5", "add(-1, 1) == 0", "add(0.5, 0.25) == 0.75"]},
    {"id": "reverse", "name": "reverse", "spec": "reverse(s) returns the string s reversed",
     "tests": ["reverse('abc') == 'cba'", "reverse('') == ''", "reverse('ab ba!') == '!ab ba'"]},
    {"id": "is_palindrome", "name": "is_palindrome", "spec": "is_palindrome(s) is True when "
                                                             "s reads the same backwards",
     "tests": ["is_palindrome('level')", "not is_palindrome('agent')", "is_palindrome('')"]},
    {"id": "count_vowels", "name": "count_vowels", "spec": "count_vowels(s) counts the "
                                                           "letters aeiou (any case) in s",
     "tests": ["count_vowels('Agent') == 2", "count_vowels('xyz') == 0", "count_vowels('AEIOU') == 5"]},
    {"id": "fib", "name": "fib", "spec": "fib(n) returns the n-th Fibonacci number, fib(0) == 0, fib(1) == 1",
     "tests": ["fib(0) == 0", "fib(1) == 1", "fib(10) == 55", "fib(30) == 832040"]},
    {"id": "dedupe", "name": "dedupe", "spec": "dedupe(xs) returns xs without repeats, "
                                               "first occurrences kept in order",
     "tests": ["dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]", "dedupe([]) == []"]},
]
# Runs in the sandbox: one fresh namespace per test, a JSON verdict on the last line.
HARNESS = """import json, sys
src, tests = open('/work/solution.py').read(), json.load(open('/work/tests.json'))
passed = 0
for t in tests:
    ns = {}
    try:
        exec(src, ns)
        passed += bool(eval(t, ns))
    except BaseException:
        pass
print(json.dumps({"passed": passed, "total": len(tests)}))
"""


def extract_code(answer: str) -> str:
    """The last fenced code block of ``answer``, or the whole answer when it has none."""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", answer, re.DOTALL)
    return blocks[-1] if blocks else answer


@agentrl.environment("coding")
class CodingEnv(agentrl.TaskListEnv):
    system_prompt = SYSTEM
    sandbox_image = "agentrl/base:bookworm"
    max_turns = 4
    TASKS = TASKS

    def prompt(self, task: dict[str, Any]) -> str:
        return f"Write a Python function: {task['spec']}."

    @agentrl.tool
    async def run_python(self, code: str) -> str:
        """Run Python code in a sandbox and return what it prints.

        Args:
            code: Python source; use print() to show results.
        """
        assert self.sandbox is not None, "the coding environment needs a sandbox"
        r = await self.sandbox.exec(["python3", "-c", code], timeout=self.timeout_s)
        out = "Error: timed out" if r.timed_out else (r.stdout + r.stderr).strip()
        return out[-2000:] or "(no output)"

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        assert self.sandbox is not None, "the coding environment needs a sandbox"
        await self.sandbox.write_file("/work/solution.py", extract_code(answer))
        await self.sandbox.write_file("/work/tests.json", json.dumps(task["tests"]))
        r = await self.sandbox.exec(["python3", "-c", HARNESS], timeout=self.timeout_s)
        try:
            verdict = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return 0.0  # the answer killed the harness (exit, hang, OOM): no test passed
        return verdict["passed"] / max(1, verdict["total"])
