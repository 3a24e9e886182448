"""An agent built with OpenAI's Agents SDK (PyPI ``openai-agents``, package ``agents``), unmodified.

The framework is used as its users use it: an ``Agent`` with instructions and a ``@function_tool``,
run by ``Runner.run``. The only agentrl-specific lines point its chat-completions model at the
session's base URL and turn tracing off (tracing would upload to OpenAI; this machine is offline).
Its ``python`` tool runs in the episode's sandbox when the environment has one.

Install: ``pip install 'agentrl[scaffolds]'``. Run: ``--scaffold.agent=scaffolds.openai_agents_sdk:agent``.
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

from scaffolds.openai_minimal import calculate

set_tracing_disabled(True)


async def agent(ctx: Any) -> str:
    """agentrl scaffold entry point (``ScaffoldContext`` in, the agent's final output out)."""

    @function_tool
    async def python(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: Python source; use print() to show results.
        """
        if ctx.sandbox is None:
            return calculate(code)
        r = await ctx.sandbox.exec(["python3", "-c", code], timeout=10)
        return ((r.stdout + r.stderr).strip() or "(no output)")[-2000:]

    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
    solver = Agent(
        name="solver", instructions=ctx.system or "Use the python tool, then answer.", tools=[python],
        model=OpenAIChatCompletionsModel(model=ctx.model, openai_client=client),
        model_settings=ModelSettings(max_tokens=ctx.max_tokens, temperature=ctx.temperature),
    )
    try:
        result = await Runner.run(solver, ctx.prompt, max_turns=8)
        return str(result.final_output or "")
    except MaxTurnsExceeded:
        return ""
    finally:
        await client.close()
