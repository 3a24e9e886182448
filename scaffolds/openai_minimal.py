"""A minimal tool-calling agent written with the official ``openai`` SDK: the template for your own.

It knows nothing of RL: it gets a base URL and a key, asks the model, runs the ``python`` tool the
model calls, and stops at the first reply without a tool call, which is its answer. agentrl runs it

- in the serve process: ``--scaffold.agent=scaffolds.openai_minimal:agent`` (the tool runs in the
  episode's sandbox when the environment has one), or
- as a program: ``--scaffold.command="{python} -m scaffolds.openai_minimal"`` (reads
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL`` and the task from ``AGENTRL_PROMPT``;
  prints its answer; its tool only evaluates arithmetic, it runs no code on the host).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import re
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from openai import AsyncOpenAI

SYSTEM = "Use the python tool to compute the answer, then reply with the number."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source"}},
                "required": ["code"],
            },
        },
    }
]


async def run_agent(client: AsyncOpenAI, model: str, messages: list[dict[str, Any]],
                    run_python: Callable[[str], Awaitable[str]], *, max_turns: int = 8,
                    max_tokens: int = 128, temperature: float = 1.0) -> str:
    """The agent loop: model -> tool calls -> tool results -> ... -> a plain reply (the answer)."""
    messages = list(messages)
    for _ in range(max_turns):
        out = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                   max_tokens=max_tokens, temperature=temperature)
        msg = out.choices[0].message
        messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not msg.tool_calls:
            return msg.content or ""
        for call in msg.tool_calls:
            try:
                code = json.loads(call.function.arguments or "{}").get("code", "")
                result = await run_python(str(code))
            except Exception as e:  # a bad call is the model's mistake: tell it
                result = f"Error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


async def agent(ctx: Any) -> str:
    """agentrl scaffold entry point (``ScaffoldContext`` in, answer out)."""
    messages = ctx.messages or [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ctx.prompt},
    ]
    async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
        return await run_agent(
            client,
            ctx.model,
            messages,
            partial(run_python, ctx),
            max_tokens=ctx.max_tokens,
            temperature=ctx.temperature,
        )


async def run_python(ctx: Any, code: str) -> str:
    """The python tool in an episode: the code runs in the episode's sandbox (the last 2,000
    characters of what it prints), or, when the environment has none, only arithmetic is evaluated."""
    if ctx.sandbox is None:
        return calculate(code)
    r = await ctx.sandbox.exec(["python3", "-c", code], timeout=10)
    return ((r.stdout + r.stderr).strip() or "(no output)")[-2000:]


_OPS: dict[type, Callable[..., Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
                                        ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(code: str) -> str:
    """Evaluate ``print(<arithmetic>)`` or ``<arithmetic>`` without running code; errors as text."""
    m = re.fullmatch(r"\s*print\((.*)\)\s*", code, re.DOTALL)
    expr = m.group(1) if m else code

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only arithmetic on numbers is supported")

    try:
        return str(ev(ast.parse(expr.strip(), mode="eval").body))
    except Exception as e:
        return f"Error: {type(e).__name__}: {e}"


async def _main() -> None:
    messages = json.loads(os.environ.get("AGENTRL_MESSAGES") or "[]") or [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": os.environ["AGENTRL_PROMPT"]}]
    async def arithmetic(code: str) -> str:  # a program has no sandbox: it runs no code on the host
        return calculate(code)

    async with AsyncOpenAI() as client:  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        answer = await run_agent(client, os.environ.get("OPENAI_MODEL", "default"), messages, arithmetic,
                                 max_tokens=int(os.environ.get("AGENTRL_MAX_TOKENS", "128")),
                                 temperature=float(os.environ.get("AGENTRL_TEMPERATURE", "1.0")))
    print(answer)


if __name__ == "__main__":
    asyncio.run(_main())
