"""A tool-using agent written with the official ``anthropic`` SDK: the Messages API, multi-turn.

It knows nothing of RL: it gets a base URL and a key, sends ``messages.create`` with a ``python``
tool, runs the ``tool_use`` blocks the model returns and answers each with a ``tool_result`` in
the next user message, and stops at the first reply without a tool call, which is its answer.
The conversation only grows (the assistant's content blocks go back as they came), so the router
stitches the episode into one sample. agentrl gives it the session's base URL without its
``/v1`` (the SDK appends ``/v1/messages``) and the session key, which the SDK sends as ``x-api-key``.
The 2.x SDK has no sampling arguments; the episode's temperature goes in ``extra_body``.

Run: ``--scaffold.agent=scaffolds.anthropic_tools:agent`` (the tool runs in the episode's sandbox
when the environment has one, else it only evaluates arithmetic).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from anthropic import AsyncAnthropic

from scaffolds.openai_minimal import run_python

SYSTEM = "Use the python tool to compute the answer, then reply with the number."
TOOLS = [
    {
        "name": "python",
        "description": "Run Python code and return what it prints.",
        "input_schema": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source"}},
            "required": ["code"],
        },
    }
]


async def run_agent(client: AsyncAnthropic, model: str, system: str, prompt: str,
                    run_python: Callable[[str], Awaitable[str]], *, max_turns: int = 8, max_tokens: int = 128,
                    temperature: float = 1.0) -> str:
    """The loop: model -> tool_use blocks -> tool_result blocks -> ... -> a reply without tools (the
    answer)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for _ in range(max_turns):
        reply = await client.messages.create(
            model=model,
            max_tokens=max_tokens,
            system=system,
            messages=messages,
            tools=TOOLS,
            extra_body={"temperature": temperature},
        )
        messages.append({"role": "assistant", "content": reply.content})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in reply.content if b.type == "text")
        results = []
        for use in uses:
            try:
                out, error = await run_python(str(use.input.get("code", ""))), False
            except Exception as e:  # a bad call is the model's mistake: tell it
                out, error = f"Error: {type(e).__name__}: {e}", True
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": out, "is_error": error})
        messages.append({"role": "user", "content": results})
    return ""


async def agent(ctx: Any) -> str:
    """agentrl scaffold entry point (``ScaffoldContext`` in, answer out)."""
    base = ctx.base_url.removesuffix("/").removesuffix("/v1")
    async with AsyncAnthropic(base_url=base, api_key=ctx.api_key, max_retries=0) as client:
        return await run_agent(client, ctx.model, ctx.system or SYSTEM, ctx.prompt, partial(run_python, ctx),
                               max_tokens=ctx.max_tokens, temperature=ctx.temperature)
