"""An agent built with OpenAI's Agents SDK (PyPI ``openai-agents``, package ``agents``), unmodified.

The framework is used as its users use it: an ``Agent`` with instructions and a ``@function_tool``,
run by ``Runner.run``. The only agentrl-specific lines point its model at the session's base URL
and turn tracing off (tracing would upload to OpenAI; this machine is offline). Its ``python``
tool runs in the episode's sandbox when the environment has one. Two entry points:

- ``agent``: the SDK's chat-completions model (``OpenAIChatCompletionsModel``);
- ``responses_agent``: its Responses model (``OpenAIResponsesModel``, the SDK's default for OpenAI),
  with ``auto_previous_response_id`` on, so each later turn sends only its new items and names the
  response it follows (the router keeps the conversation).

Install: ``pip install 'agentrl[scaffolds]'``. Run: ``--scaffold.agent=scaffolds.openai_agents_sdk:agent``
(or ``:responses_agent``).
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

from scaffolds.openai_minimal import run_python

set_tracing_disabled(True)


def _python_tool(ctx: Any) -> Any:
    @function_tool
    async def python(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: Python source; use print() to show results.
        """
        return await run_python(ctx, code)

    return python


async def _run(ctx: Any, responses: bool) -> str:
    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
    model = (OpenAIResponsesModel(model=ctx.model, openai_client=client) if responses
             else OpenAIChatCompletionsModel(model=ctx.model, openai_client=client))
    solver = Agent(
        name="solver",
        instructions=ctx.system or "Use the python tool, then answer.",
        tools=[_python_tool(ctx)],
        model=model,
        model_settings=ModelSettings(max_tokens=ctx.max_tokens, temperature=ctx.temperature),
    )
    try:
        result = await Runner.run(solver, ctx.prompt, max_turns=8, auto_previous_response_id=responses)
        return str(result.final_output or "")
    except MaxTurnsExceeded:
        return ""
    finally:
        await client.close()


async def agent(ctx: Any) -> str:
    """agentrl scaffold entry point (``ScaffoldContext`` in, the agent's final output out): chat
    completions."""
    return await _run(ctx, responses=False)


async def responses_agent(ctx: Any) -> str:
    """The same agent on the Responses API (``/v1/responses``), its turns chained by
    ``previous_response_id``."""
    return await _run(ctx, responses=True)
