"""swe: fix a bug in a small git repository until its failing test passes (SWE-bench in miniature).

Each task is a tiny Python project with an issue and a failing unit test. At ``reset`` the
project is written into the episode's Docker sandbox (``agentrl/swe:latest``: the base image plus
git, built offline by ``agentrl sandbox build``), committed as a git repository in
``/work/repo``, and its test is run once to confirm it fails (a task whose test passes before any
fix is the environment's failure, not the model's). The agent works with shell commands (the
``bash`` tool here; external agents such as mini-swe-agent run theirs through the sandbox's exec
API) and never sees how it is scored. The reward is 1.0 when the task's test command passes in
the same container after the episode and the test files are as committed (``git diff`` is empty
for them: editing the test away is not a fix), else 0.0.
"""

from __future__ import annotations

import shlex
from typing import Any

import agentrl

REPO = "/work/repo"
_GIT = "git -c user.name=agentrl -c user.email=agentrl@localhost"
TEST = "python3 -m unittest discover -s tests -t . -q"  # a task's test command unless it names its own


def _task(task_id: str, issue: str, module: str, source: str, function: str, checks: list[str],
          fix: str) -> dict[str, Any]:
    """A built-in task: ``module`` with the bug and a unittest of ``function`` asserting each of
    ``checks`` (``"add(2, 3), 5"``: the two are equal)."""
    test = (f"import unittest\n\nfrom {module} import {function}\n\n\n"
            f"class Test{function.capitalize()}(unittest.TestCase):\n    def test_{function}(self):\n"
            + "".join(f"        self.assertEqual({c})\n" for c in checks))
    return {
        "id": task_id,
        "issue": issue,
        "files": {"tests/__init__.py": "", f"{module}.py": source, f"tests/test_{module}.py": test},
        "fix": fix,
    }


TASKS = [
    _task(
        "calc-add",
        "add(2, 3) returns -1 instead of 5.",
        "calc",
        "def add(a, b):\n    return a - b\n",
        "add",
        ["add(2, 3), 5", "add(-1, 1), 0"],
        "sed -i 's/a - b/a + b/' calc.py",
    ),
    _task(
        "shout-upper",
        "shout('hi') should return 'HI!' but returns 'hi!'.",
        "text",
        "def shout(s):\n    return s.lower() + '!'\n",
        "shout",
        ["shout('hi'), 'HI!'"],
        "sed -i 's/s.lower()/s.upper()/' text.py",
    ),
    _task(
        "mean-divisor",
        "mean([2, 4]) returns 6.0 instead of 3.0.",
        "stats",
        "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n",
        "mean",
        ["mean([2, 4]), 3.0", "mean([5]), 5.0"],
        "sed -i 's/(len(xs) - 1)/len(xs)/' stats.py",
    ),
]


@agentrl.environment("swe")
class SweEnv(agentrl.TaskListEnv):
    sandbox_image = "agentrl/swe:latest"  # the base image with git (agentrl sandbox build)
    max_turns = 8
    system_prompt = (f"You are a software engineer. The repository is in {REPO}, a git "
                     "repository. Use the bash tool to inspect and fix the code so that "
                     "its tests pass; do not change the tests. Say done when finished.")
    TASKS = TASKS
    timeout_s = 30.0  # a commit or a test run in the sandbox can outlast the default 10 s

    def prompt(self, task: dict[str, Any]) -> str:
        return f"Fix this issue in the repository in {REPO}: {task['issue']}"

    async def reset(self, task: dict[str, Any]) -> agentrl.Reset:
        assert self.sandbox is not None, "the swe environment needs a sandbox"
        for path, text in task["files"].items():
            await self.sandbox.write_file(f"{REPO}/{path}", text)
        r = await self.sandbox.exec(f"cd {REPO} && git init -q && {_GIT} "
                                    f"add -A && {_GIT} commit -qm 'the bug'",
                                    timeout=self.timeout_s)
        if r.exit_code != 0:
            raise RuntimeError("could not make the repository of task "
                               f"{task['id']} ({r.exit_code}): {r.stderr[-500:]}")
        if (await self._test(task)).exit_code == 0:  # a broken task is the environment's failure
            raise RuntimeError(f"the test of task {task['id']} passes before any fix")
        return await super().reset(task)

    async def _test(self, task: dict[str, Any]) -> Any:
        assert self.sandbox is not None
        return await self.sandbox.exec(f"cd {REPO} && {task.get('test', TEST)}", timeout=self.timeout_s)

    @agentrl.tool
    async def bash(self, command: str) -> str:
        """Run a shell command in the repository and return its exit code and output.

        Args:
            command: the command line, run with /bin/sh -c in the repository.
        """
        assert self.sandbox is not None
        r = await self.sandbox.exec(command, timeout=self.timeout_s, cwd=REPO)
        out = (r.stdout + r.stderr)[-2000:]
        return f"exit {r.exit_code}" + (" (timed out)" if r.timed_out else "") + (f"\n{out}" if out else "")

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        assert self.sandbox is not None
        tests = " ".join(shlex.quote(p) for p in task["files"] if p.startswith("tests/"))
        untouched = await self.sandbox.exec(
            f"cd {REPO} && git diff --quiet HEAD -- {tests}", timeout=self.timeout_s
        )
        if untouched.exit_code != 0:
            return 0.0
        return 1.0 if (await self._test(task)).exit_code == 0 else 0.0
