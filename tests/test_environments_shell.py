"""shell: several tool calls change files in a Docker sandbox; a hidden checker script decides."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

import agentrl
from agentrl.sandbox import SandboxConfig, SandboxPool
from environments.shell import TASKS


def bash(command: str, cid: str = "c") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": cid,
                "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"command": command})},
            }
        ],
    }


DONE = {"role": "assistant", "content": "done"}
SOLUTIONS = {
    "count-errors": [bash("cat logs/app.log"), bash("grep -c ERROR logs/app.log > errors.txt")],
    "rename-txt": [bash("ls notes"), bash("for f in notes/*.txt; do mv \"$f\" \"${f%.txt}.md\"; done")],
    "delete-empty": [bash("find data -type f -empty"), bash("find data -type f -empty -delete")],
    "sort-words": [bash("cat words.txt"), bash("sort -u words.txt > sorted.txt")],
}


def test_every_built_in_task_has_setup_instruction_and_checker() -> None:
    tasks = list(agentrl.make("shell").tasks("train"))
    assert {t["id"] for t in tasks} == set(SOLUTIONS)
    assert all(t["setup"] and t["instruction"] and t["check"] for t in tasks)


@pytest.mark.docker
def test_multi_step_solutions_pass_the_checker_and_doing_nothing_fails_it() -> None:
    async def run(
        pool: SandboxPool, task: dict[str, Any], replies: list[dict[str, Any]]
    ) -> list[agentrl.StepResult]:
        env = agentrl.make("shell")
        async with pool.acquire() as sb:
            env.sandbox = sb
            opening = await env.reset(task)
            assert opening.messages[-1]["content"] == task["instruction"]
            assert task["check"] not in json.dumps(opening.messages)
            return [await env.step(m) for m in replies]

    async def body() -> None:
        cfg = SandboxConfig(backend="docker", warm=1, max_concurrency=2, memory_mb=256)
        async with SandboxPool(cfg, f"t-shell-{uuid.uuid4().hex[:6]}") as pool:
            for task in TASKS:
                results = await run(pool, task, [*SOLUTIONS[task["id"]], DONE])
                assert all(r.messages[0]["content"].startswith("exit 0") for r in results[:-1]), task["id"]
                assert results[-1].terminated and results[-1].reward == 1.0, task["id"]
                (lazy,) = await run(pool, task, [DONE])  # a fresh sandbox: the earlier work is gone
                assert lazy.terminated and lazy.reward == 0.0, task["id"]
            results = await run(pool, TASKS[0], [bash("cat nope.txt"), DONE])
            assert (
                results[0].messages[0]["content"].startswith("exit 1\n")
                and "nope.txt" in results[0].messages[0]["content"]
            )

    asyncio.run(body())


@pytest.mark.docker
def test_a_task_whose_setup_fails_is_an_environment_error() -> None:
    async def body() -> None:
        cfg = SandboxConfig(backend="docker", warm=0, max_concurrency=1, memory_mb=256)
        async with SandboxPool(cfg, f"t-shell-{uuid.uuid4().hex[:6]}") as pool:
            env = agentrl.make("shell")
            async with pool.acquire() as sb:
                env.sandbox = sb
                with pytest.raises(RuntimeError, match="setup of task broken failed"):
                    await env.reset({"id": "broken", "setup": "exit 4", "instruction": "x", "check": "true"})
    asyncio.run(body())
