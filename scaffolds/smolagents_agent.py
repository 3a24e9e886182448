"""A Hugging Face ``smolagents`` ``ToolCallingAgent``, unmodified, on the session's OpenAI endpoint.

The framework is used as its users use it: a ``@tool``-decorated function, ``OpenAIServerModel``
pointed at the session's base URL, ``ToolCallingAgent(...).run(task)``. smolagents asks for
``tool_choice="required"`` and the stop strings ``Observation:`` / ``Calling tools:``, so its
calls take the engine's render and derender routes (exact, three round trips each), and it
rebuilds its prompt from its memory every step (the reply as text, then a "Calling tools: ..."
message and an "Observation: ..." message), so each call after the first starts a new sample:
every call is still captured exactly, as its own sample (docs/scaffolds.md, compatibility).

smolagents is synchronous: it runs in a worker thread; its tool hops back onto the serve loop to
run code in the episode's sandbox. ``max_steps`` bounds its steps (it asks the model once more for
a final answer when they run out). Its default system prompt (about 3,800 characters of worked
examples) alone overflows the small test model's 2,048-token context, so the agent gets a short
one through the framework's own ``prompt_templates`` (the rest of its templates unchanged; pass
``system_prompt=None`` to keep its own). Run: ``--scaffold.agent=scaffolds.smolagents_agent:agent``.
"""

from __future__ import annotations

import asyncio
import importlib.resources
from typing import Any

import yaml
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

from scaffolds.openai_minimal import run_python

SYSTEM_PROMPT = (
    "You solve tasks with tools: call one tool per step; when you know the answer, call final_answer.\n"
    """Tools:
{%- for tool in tools.values() %}
- {{ tool.name }}: {{ tool.description }}
{%- endfor %}"""
)


def prompt_templates(system_prompt: str | None = SYSTEM_PROMPT) -> dict[str, Any]:
    """smolagents' own ToolCallingAgent templates, with ``system_prompt`` in place of its own."""
    path = importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml")
    templates = yaml.safe_load(path.read_text())
    if system_prompt is not None:
        templates["system_prompt"] = system_prompt
    return templates


def _python_tool(ctx: Any, loop: asyncio.AbstractEventLoop) -> Any:
    @tool
    def python(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: Python source; use print() to show results.
        """
        return asyncio.run_coroutine_threadsafe(run_python(ctx, code), loop).result(40)

    return python


async def agent(ctx: Any, *, max_steps: int = 2, system_prompt: str | None = SYSTEM_PROMPT) -> str:
    """agentrl scaffold entry point (``ScaffoldContext`` in, the agent's final answer out)."""
    model = OpenAIServerModel(model_id=ctx.model, api_base=ctx.base_url, api_key=ctx.api_key,
                              max_tokens=ctx.max_tokens, temperature=ctx.temperature)
    runner = ToolCallingAgent(
        tools=[_python_tool(ctx, asyncio.get_running_loop())],
        model=model,
        max_steps=max_steps,
        verbosity_level=0,
        prompt_templates=prompt_templates(system_prompt),
    )
    answer = await asyncio.to_thread(runner.run, ctx.prompt)
    return "" if answer is None else str(answer)
