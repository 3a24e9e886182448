"""``agentrl envs list | show NAME | try NAME --endpoint URL``: helpers for writing environments.

The lead wires these into ``agentrl.cli``; each returns an exit code and writes to ``out``.
``try`` plays one episode against any OpenAI-compatible endpoint (vLLM's ``/v1``, the router's
``/v1`` or ``/sessions/<id>/v1``) and prints it turn by turn: what the model said, which tools it
called, what the environment answered, rewards and why the episode ended. It is a debugging
loop, not the training loop: it records no tokens (use ``agentrl run`` for that).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Callable
from typing import Any

import aiohttp

from agentrl.env.registry import failed_entry_points, lookup, make, registered

Write = Callable[[str], Any]


def _summary(obj: Any) -> str:
    doc = obj.__doc__ or sys.modules[obj.__module__].__doc__ or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def list_envs(out: Write = sys.stdout.write, per_ecosystem: int = 0) -> int:
    """One line per registered environment; entry points that failed to load, with why; then what
    each installed ecosystem offers (``prefix:name``) and how to add the missing ones."""
    from agentrl.env import adapters

    for name in registered():
        if adapters.ecosystem_of(name) is None:
            out(f"{name:24s} {_summary(lookup(name))}\n")
    for ep, why in failed_entry_points().items():
        out(f"(failed) {ep}: {why}\n")
    for prefix, names in adapters.offered().items():
        shown = names[:per_ecosystem] if per_ecosystem > 0 else names
        out(f"\n[{prefix}] {len(names)} environment(s)\n")
        for name, about in shown:
            out(f"{name:24s} {about}\n")
        if len(shown) < len(names):
            out(f"... and {len(names) - len(shown)} more\n")
    out(f"\n{adapters.describe()}\n")
    return 0


def show_env(name: str, out: Write = sys.stdout.write, **config: Any) -> int:
    """The environment's description, an example task, and (for tool environments) tools and opening."""
    env = make(name, **config)
    task = next(iter(env.tasks("test")))
    info: dict[str, Any] = {"name": name, "class": f"{type(env).__module__}.{type(env).__qualname__}",
                            "about": _summary(type(env)), "sandbox_image": env.sandbox_image,
                            "example_task": task}
    if not info["sandbox_image"] or hasattr(env, "prompt"):
        with contextlib.suppress(Exception):  # an opening that needs a sandbox is shown without it
            opening = asyncio.run(env.reset(task))
            info.update(messages=opening.messages, tools=opening.tools)
    out(json.dumps(info, indent=2, default=str) + "\n")
    return 0


async def _chat(http: aiohttp.ClientSession, endpoint: str, body: dict[str, Any], api_key: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with http.post(f"{endpoint}/chat/completions", json=body, headers=headers) as r:
        data = await r.json(content_type=None)
        if r.status >= 400:
            raise RuntimeError(f"the endpoint answered {r.status}: {json.dumps(data)[:500]}")
        return data


async def _model_name(http: aiohttp.ClientSession, endpoint: str) -> str:
    async with http.get(f"{endpoint}/models") as r:
        return (await r.json(content_type=None))["data"][0]["id"]


async def try_episode(name: str, endpoint: str, *, model: str = "", task: dict[str, Any] | None = None,
                      max_turns: int = 8, max_tokens: int = 256, temperature: float = 0.7, api_key: str = "",
                      sandbox_config: Any = None, env_config: dict[str, Any] | None = None,
                      out: Write = sys.stdout.write, timeout_s: float = 300.0) -> dict[str, Any]:
    """Play one episode of ``name`` against ``endpoint`` and print it; returns a summary."""
    env = make(name, **(env_config or {}))
    task = task if task is not None else next(iter(env.tasks("test")))
    endpoint = endpoint.rstrip("/")
    summary: dict[str, Any] = {"env": name, "task_id": task.get("id"), "turns": 0, "reward": 0.0,
                               "ended": "max_turns"}
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)))
        stack.push_async_callback(env.close)
        from agentrl.sandbox.attach import attached, pool_for
        from agentrl.sandbox.types import SandboxConfig

        pool = await pool_for(env.sandbox_image, sandbox_config or SandboxConfig(warm=0), "envs-try")
        if pool is not None:
            stack.push_async_callback(pool.close)
        await stack.enter_async_context(attached(env, pool))
        model = model or await _model_name(http, endpoint)
        opening = await env.reset(task)
        messages = list(opening.messages)
        out(f"== {name} | task {task.get('id')} | model {model} | tools: "
            f"{', '.join(t['function']['name'] for t in opening.tools) or 'none'}\n")
        for m in messages:
            out(f"[{m['role']}] {m.get('content') or ''}\n")
        for turn in range(1, max_turns + 1):
            body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                                    "temperature": temperature}
            if opening.tools:
                body["tools"] = opening.tools
            choice = (await _chat(http, endpoint, body, api_key))["choices"][0]
            msg = {k: v for k, v in choice["message"].items() if k in ("role", "content", "tool_calls") and v}
            msg.setdefault("content", "")
            messages.append(msg)
            out(f"\n-- turn {turn} ({choice.get('finish_reason')})\n[assistant] {msg['content']}\n")
            for c in msg.get("tool_calls") or []:
                out(f"  -> {c['function']['name']}({c['function']['arguments']})\n")
            result = await env.step(msg)
            messages.extend(result.messages)
            for m in result.messages:
                out(f"[{m['role']}] {m.get('content') or ''}\n")
            summary["turns"], summary["reward"] = turn, summary["reward"] + result.reward
            out(f"   reward {result.reward:+.3f}" + (f" | info {json.dumps(result.info, default=str)}" if result.info else "") + "\n")
            if result.terminated or result.truncated:
                summary["ended"] = "terminated" if result.terminated else "truncated"
                break
    out(f"\n== {summary['ended']} after {summary['turns']} turn(s), total reward {summary['reward']:.3f}\n")
    return summary


def try_env(name: str, endpoint: str, out: Write = sys.stdout.write, **kwargs: Any) -> int:
    """``agentrl envs try NAME --endpoint URL``: exit code 0 when the episode ran to an end."""
    asyncio.run(try_episode(name, endpoint, out=out, **kwargs))
    return 0
