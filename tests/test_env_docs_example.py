"""The complete example environment in docs/environments.md runs as printed."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import agentrl
from agentrl.env.registry import unregister

DOC = Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def test_the_documented_example_environment_is_complete_and_scores_a_right_answer() -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)
    assert len(code.splitlines()) <= 60
    unregister("convert")
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    env = agentrl.make("convert", num_tasks=2)
    task = next(iter(env.tasks("test")))

    async def body() -> None:
        opening = await env.reset(task)
        assert opening.tools[0]["function"]["parameters"]["required"] == ["a", "op", "b"]
        call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": '{"a": 6, '
                                                                                               '"op": "/", '
                                                                                               '"b": 4}'}}
        tool = await env.step({"role": "assistant", "content": "", "tool_calls": [call]})
        assert tool.messages[0]["content"] == "1.5"
        done = await env.step({"role": "assistant", "content": f"{task['answer']}"})
        assert done.terminated and done.reward == 1.0
    asyncio.run(body())
    unregister("convert")
