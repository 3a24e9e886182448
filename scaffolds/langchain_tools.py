"""A LangChain agent: ``langchain-openai``'s ``ChatOpenAI`` with bound tools, in its tool-call loop.

The framework is used as its users use it: a ``@tool`` function, ``ChatOpenAI(...).bind_tools``,
``ainvoke`` on a list of messages; each ``AIMessage`` with ``tool_calls`` is answered by a
``ToolMessage`` per call, until a reply without calls, which is the answer. The conversation only
grows (LangChain sends each ``AIMessage`` back as the assistant message it came from), so the
router stitches the episode into one sample. Run: ``--scaffold.agent=scaffolds.langchain_tools:agent``.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from scaffolds.openai_minimal import SYSTEM, run_python


async def agent(ctx: Any, *, max_turns: int = 8) -> str:
    """agentrl scaffold entry point (``ScaffoldContext`` in, answer out)."""
    @tool
    async def python(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: Python source; use print() to show results.
        """
        return await run_python(ctx, code)

    llm = ChatOpenAI(model=ctx.model, base_url=ctx.base_url, api_key=ctx.api_key, temperature=ctx.temperature,
                     max_tokens=ctx.max_tokens, max_retries=0)
    bound = llm.bind_tools([python])
    messages: list[BaseMessage] = [SystemMessage(ctx.system or SYSTEM), HumanMessage(ctx.prompt)]
    for _ in range(max_turns):
        reply = await bound.ainvoke(messages)
        assert isinstance(reply, AIMessage)
        messages.append(reply)
        if not reply.tool_calls:
            return str(reply.content or "")
        for call in reply.tool_calls:
            messages.append(
                ToolMessage(content=str(await python.ainvoke(call["args"])), tool_call_id=call["id"])
            )
    return ""
