"""The built-in agent loop: one episode of an environment through the router.

model call -> tool calls -> observations -> ... until the environment terminates, or the turn,
token or wall-clock limit truncates the episode (still data, flagged with why). Every model call
goes through a router session, so the episode's samples carry the engine's exact tokens, behaviour
logprobs and per-token policy versions. An environment that raises produces a failed episode
(error recorded by class), never an exception out of this function; the sandbox is released
whatever happens, cancellation included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from agentrl.buffer.sample import Sample
from agentrl.env import make
from agentrl.errors import EnvironmentFailure
from agentrl.router.core import Router
from agentrl.router.errors import EngineError, InvalidRequest

log = logging.getLogger(__name__)

_MESSAGE_KEYS = ("role", "content", "tool_calls")


@dataclass
class EpisodeLimits:
    max_turns: int = 4
    max_tokens: int = 128  # per model call
    max_episode_tokens: int = 1024
    timeout_s: float = 300.0
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class EpisodeResult:
    episode_id: str
    group_id: str
    env: str
    task_id: str
    reward: float = 0.0
    turns: int = 0
    terminated: bool = False
    truncated: bool = False
    truncation: str | None = None  # "max_turns" | "max_tokens" | "timeout" | "context" | "env"
    error: str | None = None  # "<ErrorClass>: message" for failed episodes
    sandbox_id: str | None = None
    completion_tokens: int = 0
    versions: list[int] = field(default_factory=list)
    splits: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0
    seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k != "samples"}
        d["num_samples"] = len(self.samples)
        return d


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: message[k] for k in _MESSAGE_KEYS if message.get(k) is not None}
    out.setdefault("content", "")
    return out


async def run_episode(router: Router, env_name: str, task: dict[str, Any], *, group_id: str,
                      env_config: dict[str, Any] | None = None, sandbox_pool: Any = None,
                      limits: EpisodeLimits | None = None) -> EpisodeResult:
    limits = limits or EpisodeLimits()
    ep = EpisodeResult(episode_id=uuid.uuid4().hex, group_id=group_id, env=env_name,
                       task_id=str(task.get("id", "")), started=time.time())
    t0 = time.monotonic()
    router.open_session(ep.episode_id, group_id=group_id, env=env_name)
    try:
        async with asyncio.timeout(limits.timeout_s):
            await _episode_body(router, env_name, task, env_config or {}, sandbox_pool, limits, ep)
    except TimeoutError:
        ep.truncated, ep.truncation = True, "timeout"
    except EnvironmentFailure as e:
        ep.error = f"EnvironmentError: {e}"
    except EngineError as e:
        ep.error = f"ModelError: {e.message}"
    except Exception as e:  # sandbox infrastructure and anything unforeseen: recorded, counted
        ep.error = f"{type(e).__name__}: {e}"
        log.warning("episode %s failed: %s", ep.episode_id, ep.error)
    finally:
        ep.seconds = time.monotonic() - t0
        fetch = getattr(router, "fetch_session", None)
        if fetch is not None:  # serve's router over HTTP (a Ray rollout worker): bring the records here
            await fetch(ep.episode_id)
        finish_samples(router, ep)
    return ep


def finish_samples(router: Router, ep: EpisodeResult) -> None:
    """Close the episode's session and turn its records into ``ep.samples`` (at least one sample:
    an episode with no model call gets an empty, flagged one so its group stays countable)."""
    session = router.close_session(ep.episode_id)
    if session is not None:
        ep.splits = session.splits
        ep.samples = _samples(session, ep)
    if not ep.samples:
        ep.samples = [Sample([], [], [], [], episode_id=ep.episode_id, group_id=ep.group_id, env=ep.env,
                             reward=0.0, truncated=ep.truncated, error=ep.error or "NoModelCall")]


@contextlib.asynccontextmanager
async def episode_env(env_name: str, env_config: dict[str, Any], sandbox_pool: Any,
                      ep: EpisodeResult) -> AsyncIterator[Any]:
    """The episode's environment, with its sandbox attached when it names an image; both are
    released on the way out, cancellation included. A failure to build one is EnvironmentFailure."""
    try:
        env = make(env_name, **env_config)
    except Exception as e:
        raise EnvironmentFailure(f"could not build {env_name!r}: {type(e).__name__}: {e}") from e
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(_close_env, env)
        if getattr(env, "sandbox_image", None):
            if sandbox_pool is None:
                raise EnvironmentFailure(f"{env_name} needs a sandbox but none is configured")
            env.sandbox = await stack.enter_async_context(sandbox_pool.acquire())
            ep.sandbox_id = env.sandbox.id
        yield env


async def _episode_body(router: Router, env_name: str, task: dict[str, Any], env_config: dict[str, Any],
                        sandbox_pool: Any, limits: EpisodeLimits, ep: EpisodeResult) -> None:
    async with episode_env(env_name, env_config, sandbox_pool, ep) as env:
        try:
            opening = await env.reset(task)
        except Exception as e:
            raise EnvironmentFailure(f"reset raised {type(e).__name__}: {e}") from e
        messages = list(opening.messages)
        while True:
            if ep.turns >= limits.max_turns:
                ep.truncated, ep.truncation = True, "max_turns"
                return
            budget = min(limits.max_tokens, limits.max_episode_tokens - ep.completion_tokens)
            if budget <= 0:
                ep.truncated, ep.truncation = True, "max_tokens"
                return
            body: dict[str, Any] = {"messages": messages, "max_tokens": budget,
                                    "temperature": limits.temperature, "top_p": limits.top_p}
            if opening.tools:
                body["tools"] = opening.tools
            try:
                out = await router.chat(body, session_id=ep.episode_id)
            except InvalidRequest as e:
                if e.code == "context_length_exceeded":
                    ep.truncated, ep.truncation = True, "context"
                    return
                raise
            ep.turns += 1
            versions = out.get("agentrl", {}).get("versions", [[]])[0]
            ep.versions.extend(sorted(set(versions)))
            # a plain OpenAI endpoint (agentrl eval) returns no token ids: count its usage instead
            ep.completion_tokens += len(out["choices"][0].get("token_ids") or []) or int(
                (out.get("usage") or {}).get("completion_tokens") or 0)
            message = _clean(out["choices"][0]["message"])
            messages.append(message)
            try:
                result = await env.step(message)
            except Exception as e:
                raise EnvironmentFailure(f"step raised {type(e).__name__}: {e}") from e
            ep.reward += result.reward
            ep.info.update(result.info)
            messages.extend(result.messages)
            if result.terminated:
                ep.terminated = True
                return
            if result.truncated:
                ep.truncated, ep.truncation = True, "env"
                return
            if out["choices"][0].get("finish_reason") == "length" and ep.completion_tokens >= limits.max_episode_tokens:
                ep.truncated, ep.truncation = True, "max_tokens"
                return


async def _close_env(env: Any) -> None:
    try:
        await env.close()
    except Exception:
        log.warning("environment close() raised", exc_info=True)


def _samples(session: Any, ep: EpisodeResult) -> list[Sample]:
    """The session's samples (numpy per-token fields, built once) with the episode's fields."""
    return [replace(s, episode_id=ep.episode_id, group_id=ep.group_id, env=ep.env, reward=ep.reward,
                    truncated=ep.truncated, error=ep.error,
                    info={"task_id": ep.task_id, "turns": ep.turns, "sandbox_id": ep.sandbox_id,
                          "calls": s.info["calls"], "truncation": ep.truncation, "splits": ep.splits},
                    timings={"episode_s": ep.seconds, "started": ep.started})
            for s in session.samples()]
