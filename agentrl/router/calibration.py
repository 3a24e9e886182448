"""Probe requests, and the checks that decide what the router may do without asking the engine.

Two properties are checked on a live engine before they are relied on, never assumed:

- the local render and derender (:class:`~agentrl.router.render.LocalRenderer`) give the engine's
  own prompt ids, sampling parameters and parsed messages on :func:`calibration_bodies` and
  :data:`CALIBRATION_OUTPUTS` (and on every conversation the continuation check renders);
- a continued session call may render only its new messages (:func:`check_continuations`):
  for each probe conversation ``C`` (ending with an assistant reply) and new messages ``N``, the
  tokens the template adds after the reply, rendered after the short fixed
  :data:`BASE_CONVERSATION` ``D`` (``R(D + N, gen)[len(R(D)):]``, with ``R(D)``'s end of turn),
  are exactly those rendered after ``C`` itself (``R(C + N, gen)[len(R(C)):]``, with ``R(C)``'s
  end of turn). That holds for templates that render each message on its own (the ChatML family,
  SmolLM2, Qwen2.5) and fails for those that rewrite earlier turns (e.g. dropping past reasoning)
  or number messages; then every continued call renders the whole conversation twice, as exact
  as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from agentrl.router.sessions import continuation_tail

if TYPE_CHECKING:
    from agentrl.engines.pool import Engine, EnginePool

# The base a continued call's new messages are rendered after: short, and ending with an assistant
# reply as a continued call's conversation does. Tools, when the request has any, render with it.
BASE_CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "."},
    {"role": "assistant", "content": "."},
]

TOOLS = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]

_CALL = {"id": "c1", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(1)"}'}}
_BAD = {"id": "c2", "type": "function", "function": {"name": "python", "arguments": "{not json"}}


def calibration_bodies(model: str) -> list[dict[str, Any]]:
    """Probe requests: plain, system prompt, tools, a tool round trip with invalid arguments, sampling
    (temperature, top_p, top_k, min_p, the three penalties; greedy; a temperature vLLM raises)."""
    return [
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True},
        {
            "model": model,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓"}],
            "logprobs": True, "n": 2, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["x"],
            "max_tokens": 7,
        },
        {
            "model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_k": 7,
            "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        },
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "temperature": 0},
        {
            "model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "temperature": 0.001, "top_k": -1,
        },
        {
            "model": model, "tools": TOOLS, "logprobs": True, "max_tokens": 16,
            "messages": [
                {"role": "system", "content": "Use tools."}, {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": None, "tool_calls": [_CALL, _BAD]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
                {"role": "tool", "tool_call_id": "c2", "content": "error"},
            ],
        },
    ]


CALIBRATION_OUTPUTS = (
    "plain answer",
    'ok <tool_call>\n{"name": "python", "arguments": {"code": "print(\'é\')"}}\n</tool_call>',
    '<tool_call>\n{"name": "python", "arguments": {"code": "1"}\n</tool_call>',  # invalid JSON
)


def continuation_probes() -> list[
    tuple[str, list[dict[str, Any]] | None, list[dict[str, Any]], list[dict[str, Any]]]
]:
    """(name, tools, C, N): a conversation ending with an assistant reply, and what follows it."""
    user, sys_ = {"role": "user", "content": "What is 1+1?"}, {"role": "system", "content": "Use the tools."}
    calls = {"role": "assistant", "content": None, "tool_calls": [_CALL]}
    return [
        (
            "multi-turn", None, [user, {"role": "assistant", "content": "2"}],
            [{"role": "user", "content": "and 2+2?"}],
        ),
        (
            "empty reply, several new messages",
            None,
            [
                {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                {"role": "user", "content": "three"}, {"role": "assistant", "content": ""},
            ],
            [
                {"role": "user", "content": "four"}, {"role": "assistant", "content": "five"},
                {"role": "user", "content": "héllo ✓"},
            ],
        ),
        (
            "system prompt", None,
            [{"role": "system", "content": "Be brief."}, user, {"role": "assistant", "content": "2"}],
            [{"role": "user", "content": "sure?"}],
        ),
        (
            "reasoning in a past reply", None,
            [user, {"role": "assistant", "content": "<think>1+1</think>2"}],
            [{"role": "user", "content": "thanks"}],
        ),
        (
            "tool call, its result", TOOLS, [sys_, user, calls],
            [{"role": "tool", "tool_call_id": "c1", "content": "2"}],
        ),
        (
            "text and tool calls with valid and invalid JSON arguments", TOOLS,
            [sys_, user, {"role": "assistant", "content": "Let me check.", "tool_calls": [_CALL, _BAD]}],
            [
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
                {"role": "tool", "tool_call_id": "c2", "content": "error: bad arguments"},
            ],
        ),
        (
            "a user turn after tools",
            TOOLS,
            [
                sys_, user, calls, {"role": "tool", "tool_call_id": "c1", "content": "2"},
                {"role": "assistant", "content": "It is 2."},
            ],
            [{"role": "user", "content": "And 2+2?"}],
        ),
        (
            "tools, plain reply", TOOLS, [user, {"role": "assistant", "content": "2"}],
            [{"role": "user", "content": "use python"}],
        ),
    ]


Render = Callable[[dict[str, Any], list[dict[str, Any]], bool], Awaitable[list[int]]]


def probe_renders(model: str) -> list[tuple[dict[str, Any], list[dict[str, Any]], bool]]:
    """Every (body, messages, add_generation_prompt) that :func:`check_continuations` renders."""
    out = []
    for _, tools, conv, new in continuation_probes():
        body = _probe_body(model, tools, conv + new)
        out += [(body, conv + new, True), (body, conv, False), (body, BASE_CONVERSATION + new, True),
                (body, BASE_CONVERSATION, False)]
    return out


async def check_continuations(render: Render, eos_ids: set[int], model: str) -> str | None:
    """Whether rendering only a continued call's new messages after :data:`BASE_CONVERSATION` gives
    exactly the tokens rendering the whole conversation twice gives, on every probe; the first
    difference, or None. ``render(body, messages, add_generation_prompt)`` is the renderer's."""
    async def one(name: str, tools: list[dict[str, Any]] | None, conv: list[dict[str, Any]],
                  new: list[dict[str, Any]]) -> str | None:
        body = _probe_body(model, tools, conv + new)
        full, base, dfull, dbase = await asyncio.gather(
            render(body, conv + new, True), render(body, conv, False),
            render(body, BASE_CONVERSATION + new, True), render(body, BASE_CONVERSATION, False))
        want = continuation_tail(base, full, eos_ids)
        if want is None:
            return f"{name}: the template does not extend the conversation by the new messages' tokens"
        got = continuation_tail(dbase, dfull, eos_ids)
        if got != want:
            return (f"{name}: after the base conversation the new "
                    f"messages render as {got}, after their own as {want}")
        return None

    results = await asyncio.gather(*(one(*p) for p in continuation_probes()))
    return next((r for r in results if r is not None), None)


async def served_model(pool: EnginePool, engine: Engine) -> str:
    """The model name the engine serves (what its routes expect in ``model``)."""
    import aiohttp

    async with pool._http.get(engine.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
        data = await r.json()
    return data["data"][0]["id"]


# vLLM's SamplingParams defaults: its render route leaves out some fields that hold them.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1, "max_tokens": 16, "top_k": 0, "skip_special_tokens": True, "seed": None, "stop": [],
    "stop_token_ids": [], "logprobs": None, "output_kind": 0, "skip_clone": False, "bad_words": [],
    "skip_reading_prefix_cache": False, "temperature": 1.0, "top_p": 1.0, "min_p": 0.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "output_text_buffer_length": 0, "ignore_eos": False, "min_tokens": 0,
}


def same_sampling(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same sampling parameters once fields left out are read as vLLM's defaults."""
    return all(
        a.get(k, SAMPLING_DEFAULTS.get(k)) == b.get(k, SAMPLING_DEFAULTS.get(k)) for k in a.keys() | b.keys()
    )


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as the client sees them, tool-call ids aside (those are random on both sides)."""
    def strip(m: dict[str, Any]) -> dict[str, Any]:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]
        return m
    return strip(a) == strip(b)


def _probe_body(
    model: str, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "logprobs": True}
    if tools:
        body["tools"] = tools
    return body
