"""``agentrl envs try NAME --endpoint URL``: play one episode of any environment and print it.

It plays against any OpenAI-compatible endpoint (vLLM's ``/v1``, the router's ``/v1`` or
``/sessions/<id>/v1``) and prints the episode turn by turn: what the model said, which tools it
called, what the environment answered, rewards and why the episode ended. An environment that
plays its own episodes (:class:`~agentrl.env.base.PlayingEnv`: verifiers, TextArena) is played by
the rollout's own :func:`~agentrl.rollout.episode.play_episode`, under the same limits, each of its
model calls printed as it goes; any other by the built-in loop's turns (model call, ``step``).
The model is reached through :class:`~agentrl.rollout.remote.OpenAIChat`, the agent loop's client
for a plain endpoint. It is a debugging loop, not the training loop: it records no tokens (use
``agentrl run`` for that). A failed episode is reported (``error``, last line) and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agentrl.env import make
from agentrl.env.base import PlayingEnv, Reset
from agentrl.rollout.config import EpisodeLimits
from agentrl.rollout.episode import EpisodeResult, SessionModel, play_episode
from agentrl.rollout.remote import OpenAIChat
from agentrl.sandbox.attach import attached, pool_for
from agentrl.sandbox.types import SandboxConfig

if TYPE_CHECKING:
    from agentrl.env.base import Environment
    from agentrl.rollout.protocols import ChatClient
    from agentrl.router.sessions import SessionSummary

Write = Callable[[str], Any]


def _text(content: Any) -> str:
    """A message's content as text (OpenAI content parts are joined)."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content or "")


def _print_reply(out: Write, turn: int, choice: dict[str, Any]) -> dict[str, Any]:
    msg = {k: v for k, v in choice["message"].items() if k in ("role", "content", "tool_calls") and v}
    msg.setdefault("content", "")
    out(f"\n-- turn {turn} ({choice.get('finish_reason')})\n[assistant] {_text(msg['content'])}\n")
    for c in msg.get("tool_calls") or []:
        out(f"  -> {c['function']['name']}({c['function']['arguments']})\n")
    return msg


def _key(message: dict[str, Any]) -> tuple[str, str]:
    # a game strips the opening's observation when it puts it in a player's chat: compare the text
    return str(message.get("role")), _text(message.get("content")).strip()


class _Printed:
    """A :class:`~agentrl.rollout.protocols.ChatClient` that prints each call of an environment that
    plays its own episodes: what is new in the request since the model's last reply there (the
    environment's answer, or a new player's opening), then the reply. Messages already printed as
    the opening are not printed again."""

    def __init__(self, client: ChatClient, out: Write, opening: list[dict[str, Any]]) -> None:
        self.client, self.out = client, out
        self.opening = {_key(m) for m in opening}
        self.model_name = client.model_name
        self.calls = 0

    async def begin(self, session_id: str, **kw: Any) -> None:
        await self.client.begin(session_id, **kw)

    async def end(self, session_id: str) -> SessionSummary | None:
        return await self.client.end(session_id)

    async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
        messages = list(body.get("messages") or [])
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        for m in messages[last + 1:]:
            if _key(m) not in self.opening:
                self.out(f"[{m.get('role')}] {_text(m.get('content'))}\n")
        reply = await self.client.chat(body, session_id=session_id)
        self.calls += 1
        _print_reply(self.out, self.calls, reply["choices"][0])
        return reply


async def _play(env: PlayingEnv, task: dict[str, Any], client: ChatClient, opening: list[dict[str, Any]],
                limits: EpisodeLimits, summary: dict[str, Any], out: Write) -> None:
    """The rollout's way of playing a :class:`PlayingEnv` (its limits, its model, how the episode
    ended), with every call printed."""
    ep = EpisodeResult(episode_id=uuid.uuid4().hex, group_id="envs-try", env=summary["env"],
                       task_id=str(task.get("id", "")))
    try:
        await play_episode(env, task, SessionModel(_Printed(client, out, opening), ep, limits))
    finally:
        summary["turns"] = ep.turns  # what it spent, also when it failed
    summary.update(reward=ep.reward, info=ep.info,
                   ended="terminated" if ep.terminated else f"truncated ({ep.truncation})")
    if ep.info:
        out(f"   info {json.dumps(ep.info, default=str)}\n")


async def _step(env: Environment, opening: Reset, client: ChatClient, limits: EpisodeLimits,
                summary: dict[str, Any], out: Write) -> None:
    """The built-in loop's turns (model call, ``step``), each printed with its reward."""
    messages = list(opening.messages)
    for turn in range(1, limits.max_turns + 1):
        body: dict[str, Any] = {"messages": messages, "max_tokens": limits.max_tokens,
                                "temperature": limits.temperature}
        if opening.tools:
            body["tools"] = opening.tools
        msg = _print_reply(out, turn, (await client.chat(body))["choices"][0])
        messages.append(msg)
        result = await env.step(msg)
        messages.extend(result.messages)
        for m in result.messages:
            out(f"[{m['role']}] {_text(m.get('content'))}\n")
        summary["turns"], summary["reward"] = turn, summary["reward"] + result.reward
        info = f" | info {json.dumps(result.info, default=str)}" if result.info else ""
        out(f"   reward {result.reward:+.3f}{info}\n")
        if result.terminated or result.truncated:
            summary["ended"] = "terminated" if result.terminated else "truncated"
            return


async def try_episode(name: str, endpoint: str, *, model: str = "", task: dict[str, Any] | None = None,
                      max_turns: int = 8, max_tokens: int = 256, temperature: float = 0.7, api_key: str = "",
                      sandbox_config: SandboxConfig | None = None, env_config: dict[str, Any] | None = None,
                      out: Write = sys.stdout.write, timeout_s: float = 300.0) -> dict[str, Any]:
    """Play one episode of ``name`` against ``endpoint`` and print it; returns a summary (``error``:
    why the episode failed, None when it ran to an end). An environment that plays its own episodes
    (verifiers, TextArena) plays through the rollout's own path, its calls printed as they go."""
    env = make(name, **(env_config or {}))
    task = task if task is not None else next(iter(env.tasks("test")))
    limits = EpisodeLimits(max_turns=max_turns, max_tokens=max_tokens, temperature=temperature,
                           max_episode_tokens=max_turns * max_tokens, episode_timeout_s=timeout_s)
    summary: dict[str, Any] = {"env": name, "task_id": task.get("id"), "turns": 0, "reward": 0.0,
                               "ended": "max_turns", "error": None}
    deadline = asyncio.timeout(timeout_s)
    try:
        async with contextlib.AsyncExitStack() as stack, deadline:
            client = await stack.enter_async_context(OpenAIChat(endpoint, api_key=api_key, model=model,
                                                                timeout_s=timeout_s))
            stack.push_async_callback(env.close)
            pool = await pool_for(env.sandbox_image, sandbox_config or SandboxConfig(warm=0), "envs-try")
            if pool is not None:
                stack.push_async_callback(pool.close)
            await stack.enter_async_context(attached(env, pool, task))
            opening = await env.reset(task)
            out(f"== {name} | task {task.get('id')} | model {client.model_name} | tools: "
                f"{', '.join(t['function']['name'] for t in opening.tools) or 'none'}\n")
            for m in opening.messages:
                out(f"[{m['role']}] {_text(m.get('content'))}\n")
            if isinstance(env, PlayingEnv):
                await _play(env, task, client, list(opening.messages), limits, summary, out)
            else:
                await _step(env, opening, client, limits, summary, out)
    except Exception as e:
        if not (isinstance(e, TimeoutError) and deadline.expired()):
            summary.update(ended="failed", error=f"{type(e).__name__}: {e}")
            out(f"\n== failed after {summary['turns']} turn(s): {summary['error']}\n")
            return summary
        # as the rollout counts the wall clock
        summary["ended"] = f"truncated (timeout after {timeout_s:g} s)"
    out(f"\n== {summary['ended']} after {summary['turns']} turn(s), total reward {summary['reward']:.3f}\n")
    return summary


def try_env(name: str, endpoint: str, out: Write = sys.stdout.write, **kwargs: Any) -> int:
    """``agentrl envs try NAME --endpoint URL``: exit code 0 when the episode ran to an end, 1 when it
    failed."""
    return 0 if asyncio.run(try_episode(name, endpoint, out=out, **kwargs))["error"] is None else 1
