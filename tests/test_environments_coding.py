"""coding: answers scored by unit tests run in a Docker sandbox, driven by a scripted model."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

import agentrl
from agentrl.sandbox import SandboxConfig, SandboxPool
from environments.coding import TASKS, extract_code


def test_the_answer_code_is_the_last_fenced_block_or_the_whole_reply() -> None:
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nand\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("def f(): return 1") == "def f(): return 1"


def test_every_built_in_task_has_a_spec_and_tests_naming_its_function() -> None:
    env = agentrl.make("coding")
    tasks = list(env.tasks("train"))
    assert len(tasks) == len(TASKS) >= 5
    for t in tasks:
        assert t["name"] in t["spec"] and all(t["name"] in test for test in t["tests"])


async def episode(
    pool: SandboxPool, task: dict[str, Any], replies: list[dict[str, Any]]
) -> list[agentrl.StepResult]:
    env = agentrl.make("coding", timeout_s=5.0)
    async with pool.acquire() as sb:
        env.sandbox = sb
        opening = await env.reset(task)
        assert task["spec"] in opening.messages[-1]["content"]
        assert task["tests"][-1] not in json.dumps(opening.messages)  # the tests stay hidden
        return [await env.step(m) for m in replies]


def answer(code: str) -> dict[str, Any]:
    return {"role": "assistant", "content": f"Here it is:\n```python\n{code}\n```"}


@pytest.mark.docker
def test_answers_are_scored_by_the_fraction_of_unit_tests_passing_in_the_sandbox() -> None:
    fib = next(t for t in TASKS if t["id"] == "fib")
    try_call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {
                    "name": "run_python",
                    "arguments": json.dumps({"code": "import os; print(os.getcwd(), 6 * 7)"}),
                },
            }
        ],
    }

    async def body() -> None:
        cfg = SandboxConfig(backend="docker", warm=1, max_concurrency=2, memory_mb=256)
        async with SandboxPool(cfg, f"t-coding-{uuid.uuid4().hex[:6]}") as pool:
            right = ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
                     "    return a")
            tried, done = await episode(pool, fib, [try_call, answer(right)])
            assert tried.messages[0]["content"] == "/work 42" and not tried.terminated
            assert done.terminated and done.reward == 1.0
            half = "def fib(n):\n    return n"  # right for 0 and 1 only
            (r,) = await episode(pool, fib, [answer(half)])
            assert r.reward == 0.5
            for bad in ["def fib(n):\n    while True: pass", "import os\nos._exit(0)", "this is not python",
                        "def fib(n):\n    raise SystemExit(3)"]:
                (r,) = await episode(pool, fib, [answer(bad)])
                assert r.terminated and r.reward == 0.0, bad
    asyncio.run(body())
