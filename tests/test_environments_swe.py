"""swe: each shipped task is a git repository with a failing test in a Docker sandbox; its fix
passes, doing nothing or editing the test away does not."""

from __future__ import annotations

import asyncio
import uuid

import pytest

import agentrl
from agentrl.sandbox import SandboxConfig, SandboxPool
from environments.swe import REPO, TASKS


def test_every_shipped_task_has_an_issue_a_test_and_a_fix() -> None:
    tasks = list(agentrl.make("swe").tasks("train"))
    assert {t["id"] for t in tasks} == {t["id"] for t in TASKS} and len(tasks) >= 3
    for t in tasks:
        assert t["issue"] and t["fix"] and any(p.startswith("tests/") for p in t["files"])


@pytest.mark.docker
def test_the_fix_passes_doing_nothing_fails_and_editing_the_test_is_not_a_fix() -> None:
    async def episode(pool: SandboxPool, task: dict, command: str | None) -> tuple[float, str]:
        env = agentrl.make("swe")
        async with pool.acquire() as sb:
            env.sandbox = sb
            opening = await env.reset(task)
            assert REPO in opening.messages[-1]["content"] and [
                t["function"]["name"] for t in opening.tools
            ] == ["bash"]
            log = (await sb.exec(f"cd {REPO} && git log --oneline", timeout=10)).stdout
            if command:
                await env.bash(command)
            return await env.reward(task, "done"), log

    async def body() -> None:
        cfg = SandboxConfig(
            backend="docker", image="agentrl/swe:latest", warm=0, max_concurrency=2, memory_mb=256
        )
        async with SandboxPool(cfg, f"t-swe-{uuid.uuid4().hex[:6]}") as pool:
            for task in TASKS:
                fixed, log = await episode(pool, task, task["fix"])
                assert fixed == 1.0 and "the bug" in log  # a real git repository, one commit
                assert (await episode(pool, task, None))[0] == 0.0
                test = next(p for p in task["files"] if p.startswith("tests/test_"))
                cheat = f"printf 'import unittest\\n' > {test}"  # the test emptied: passes, but not a fix
                assert (await episode(pool, task, cheat))[0] == 0.0

    asyncio.run(body())
