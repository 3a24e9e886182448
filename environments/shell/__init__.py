"""Shell tasks: inspect and change files in a container with several tool calls; a checker decides.

Each task has a setup script (run in the episode's Docker sandbox before the model sees anything),
an instruction, and a checker script that exits 0 when the files are as asked. The model works
with the ``bash`` tool and says when it is done (a reply without a tool call); the reward is 1.0 if
the checker passes then, else 0.0. The checker runs after the episode's last command, in the same
sandbox, and the model never sees it.
"""

from __future__ import annotations

from typing import Any

import agentrl

SYSTEM = "You are in a Linux shell in /work. Use the bash tool to do the task, then say done."
TASKS = [
    {"id": "count-errors", "setup": "mkdir -p logs && printf 'ok\\nERROR "
                                    "a\\nok\\nERROR b\\nERROR c\\n' > logs/app.log",
     "instruction": "Write the number of lines of logs/app.log that contain ERROR into errors.txt.",
     "check": "test \"$(tr -d ' \\n' < errors.txt)\" = 3"},
    {"id": "rename-txt", "setup": "mkdir -p notes && touch notes/a.txt notes/b.txt notes/keep.md",
     "instruction": "Rename every .txt file in notes/ to end in .md instead.",
     "check": "test -f notes/a.md && test -f notes/b.md && test "
              "-f notes/keep.md && ! ls notes/*.txt 2>/dev/null"},
    {"id": "delete-empty", "setup": "mkdir -p data && echo x > data/full "
                                    "&& : > data/empty1 && : > data/empty2",
     "instruction": "Delete every empty file in data/ and keep the others.",
     "check": "test -s data/full && test ! -e data/empty1 && test ! -e data/empty2"},
    {"id": "sort-words", "setup": "printf 'pear\\napple\\npear\\nfig\\n' > words.txt",
     "instruction": "Write the distinct lines of words.txt, sorted, into sorted.txt.",
     "check": "test \"$(cat sorted.txt)\" = \"$(printf 'apple\\nfig\\npear')\""},
]


@agentrl.environment("shell")
class ShellEnv(agentrl.TaskListEnv):
    system_prompt = SYSTEM
    sandbox_image = "agentrl/base:bookworm"
    max_turns = 8
    TASKS = TASKS

    async def reset(self, task: dict[str, Any]) -> agentrl.Reset:
        assert self.sandbox is not None, "the shell environment needs a sandbox"
        r = await self.sandbox.exec(task["setup"], timeout=self.timeout_s)
        if r.exit_code != 0:  # a broken task is the environment's failure, not the model's
            raise RuntimeError(f"setup of task {task['id']} failed ({r.exit_code}): {r.stderr[-500:]}")
        return await super().reset(task)

    def prompt(self, task: dict[str, Any]) -> str:
        return task["instruction"]

    @agentrl.tool
    async def bash(self, command: str) -> str:
        """Run a shell command in /work and return its exit code and output.

        Args:
            command: the command line, run with /bin/sh -c.
        """
        assert self.sandbox is not None
        r = await self.sandbox.exec(command, timeout=self.timeout_s)
        out = (r.stdout + r.stderr)[-2000:]
        why = " (timed out)" if r.timed_out else " (killed: out of memory)" if r.oom_killed else ""
        return f"exit {r.exit_code}{why}" + (f"\n{out}" if out else "")

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        assert self.sandbox is not None
        r = await self.sandbox.exec(task["check"], timeout=self.timeout_s)
        return 1.0 if r.exit_code == 0 else 0.0
