"""A software-engineering agent in the style of mini-swe-agent: bash only, one command per turn.

Each reply must hold exactly one fenced ``bash`` block; the command runs in the episode's sandbox
container (through the sandbox's exec API: the container has no network, the agent runs on the
host) and its exit code and output come back as the next user message. The agent stops when a
command's output starts with ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``; what follows that line is
its submission (for the ``coding`` environment: the solution's source, which the environment
tests in the same container). Model calls are streamed (``stream=True``), as interactive agents do.

The protocol (prompt, action format, submit marker, format-error and limit handling) follows
mini-swe-agent's text-based configuration, in one file with no dependency beyond ``openai``;
mini-swe-agent itself runs as ``scaffolds.mini_swe_agent``. Run:
``--scaffold.agent=scaffolds.swe_shell:agent``.
"""

from __future__ import annotations

import re
from typing import Any

from openai import AsyncOpenAI

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SYSTEM = f"""You are a software engineer working in a Linux shell in /work.
Each response must contain exactly ONE bash code block with ONE command, preceded by your reasoning:

THOUGHT: what you want to do and why.

```bash
your_command_here
```

Every command runs in a new subshell in /work. When the work is done, submit with
`echo {SUBMIT} && cat <the file you wrote>` and nothing else."""
INSTANCE = """Task: {task}

Write the solution to /work/solution.py, check it with python3, then submit it."""
FORMAT_ERROR = ("Format error: your reply must contain exactly one ```bash block. "
                f"To finish, run `echo {SUBMIT} && cat /work/solution.py`.")
_BLOCK = re.compile(r"```(?:bash|sh)?\s*\n(.*?)```", re.DOTALL)


async def agent(ctx: Any, *, max_steps: int = 30, max_format_errors: int = 3) -> str:
    """agentrl scaffold entry point: returns the submission ("" when it never submitted)."""
    if ctx.sandbox is None:
        raise RuntimeError("swe_shell needs an environment with a sandbox (e.g. coding, shell)")
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": INSTANCE.format(task=ctx.prompt)}]
    format_errors = 0
    async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
        for _ in range(max_steps):
            reply = await _ask(client, ctx, messages)
            messages.append({"role": "assistant", "content": reply})
            blocks = _BLOCK.findall(reply)
            if len(blocks) != 1:
                format_errors += 1
                if format_errors >= max_format_errors:
                    return ""
                messages.append({"role": "user", "content": FORMAT_ERROR})
                continue
            format_errors = 0
            r = await ctx.sandbox.exec(blocks[0], timeout=30)
            output = r.stdout + r.stderr
            if output.lstrip().startswith(SUBMIT):
                return output.lstrip()[len(SUBMIT):].lstrip("\n")
            note = " (timed out)" if r.timed_out else ""
            messages.append({"role": "user", "content": f"<returncode>{r.exit_code}{note}</returncode>\n"
                                                        f"<output>\n{output[-4000:]}</output>"})
    return ""


async def _ask(client: AsyncOpenAI, ctx: Any, messages: list[dict[str, Any]]) -> str:
    """One streamed model call; the reply's text."""
    stream = await client.chat.completions.create(model=ctx.model, messages=messages, stream=True,
                                                  max_tokens=ctx.max_tokens, temperature=ctx.temperature)
    parts: list[str] = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)
