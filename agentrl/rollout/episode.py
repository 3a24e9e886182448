"""The built-in agent loop: one episode of an environment through the router.

model call -> tool calls -> observations -> ... until the environment terminates, or the turn,
token or wall-clock limit truncates the episode (still data, flagged with why). An environment
that plays its own episodes (:class:`~agentrl.env.base.PlayingEnv`, e.g. an ecosystem adapter)
gets the same session and limits as a :class:`SessionModel` and drives the calls itself. Every model call
goes through a router session, so the episode's samples carry the engine's exact tokens, behaviour
logprobs and per-token policy versions. An environment that raises produces a failed episode
(its ``error_kind`` says which boundary failed, ``error`` what happened), never an exception out of
this function; the sandbox is released whatever happens, cancellation included.

The loop talks to a :class:`~agentrl.rollout.protocols.ChatClient` (serve's router in-process or
over HTTP, or a plain OpenAI endpoint); :class:`BuiltinLoop` is its
:class:`~agentrl.rollout.protocols.EpisodeProducer` for the orchestrator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.buffer.sample import POLICY_KEY, Sample
from agentrl.env import make
from agentrl.env.base import MIX_TAG, SUCCESS_KEY, Played, PlayingEnv
from agentrl.env.roles import MultiAgentEnv
from agentrl.errors import EnvironmentFailure, ErrorKind, ScaffoldError, TransportError
from agentrl.rollout.calls import SessionModel, episode_samples
from agentrl.rollout.config import EpisodeLimits, RoleBinding
from agentrl.rollout.protocols import ChatClient
from agentrl.rollout.roles import Cast, RoleBaselines
from agentrl.router.errors import EngineError, InvalidRequest, RouterError
from agentrl.router.sessions import SessionSummary
from agentrl.sandbox.attach import ImagePools, attached
from agentrl.sandbox.types import SandboxError

if TYPE_CHECKING:
    from agentrl.env.base import Environment
    from agentrl.sandbox.pool import SandboxPool

log = logging.getLogger(__name__)

__all__ = ["BuiltinLoop", "EpisodeLimits", "EpisodeResult", "SessionModel", "episode_samples", "error_kind",
           "play_episode", "run_episode"]

_MESSAGE_KEYS = ("role", "content", "tool_calls")


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
    error_kind: ErrorKind | None = None  # which boundary failed (model, environment, sandbox, ...)
    sandbox_id: str | None = None
    completion_tokens: int = 0
    versions: list[int] = field(default_factory=list)
    splits: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    sample_rewards: dict[int, float] = field(default_factory=dict)  # leaf call index -> its sample's reward
    answer: str = ""  # the episode's final reply (what a judge of the scoring stage grades)
    started: float = 0.0
    seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k not in ("samples", "answer")}
        d["num_samples"] = len(self.samples)
        d["sample_ids"] = [s.sample_id for s in self.samples]  # what an audit of the buffer checks by id
        return d

    def fail(self, kind: ErrorKind, message: str) -> None:
        self.error_kind, self.error = kind, message


def is_success(ep: EpisodeResult, success_reward: float = 0.0) -> bool:
    """Whether an episode succeeded: the environment's declared success where it declares one, else a
    reward above ``success_reward``; an episode that failed or was cut short never succeeds."""
    if ep.error is not None or not ep.terminated or ep.truncated:
        return False
    declared = ep.info.get(SUCCESS_KEY)
    return bool(declared) if declared is not None else ep.reward > success_reward


def error_kind(e: BaseException) -> ErrorKind:
    """The boundary an exception crossed, as a failed episode records it."""
    if isinstance(e, ScaffoldError):
        return "scaffold"
    if isinstance(e, SandboxError):
        return "sandbox"
    if isinstance(e, TransportError):
        return "transport"
    if isinstance(e, EngineError):
        return "model"
    # the environment's own failure, or a request built from it that the router refused (4xx)
    return "environment"


def record_failure(ep: EpisodeResult, e: Exception) -> None:
    """Record the exception an episode ended on, as its error kind and message. The environment's
    and the model's failures are the expected ones; anything else (sandbox infrastructure, transport,
    the unforeseen) is also logged."""
    if isinstance(e, EnvironmentFailure):
        ep.fail("environment", f"EnvironmentError: {e}")
    elif isinstance(e, EngineError):
        ep.fail("model", f"ModelError: {e.message}")
    else:
        ep.fail(error_kind(e), f"{type(e).__name__}: {e}")
        log.warning("episode %s failed: %s", ep.episode_id, ep.error)


def _clean(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: message[k] for k in _MESSAGE_KEYS if message.get(k) is not None}
    out.setdefault("content", "")
    return out


async def run_episode(client: ChatClient, env_name: str, task: dict[str, Any], *, group_id: str,
                      env_config: dict[str, Any] | None = None,
                      sandbox_pool: SandboxPool | ImagePools | None = None,
                      limits: EpisodeLimits | None = None,
                      roles: Mapping[str, RoleBinding] | None = None,
                      baselines: RoleBaselines | None = None) -> EpisodeResult:
    """Play one episode of ``task``. ``roles``: a multi-agent environment's bindings (``env.roles``);
    ``baselines``: the running baselines its roles with ``advantage: baseline`` share."""
    limits = limits or EpisodeLimits()
    ep = EpisodeResult(episode_id=uuid.uuid4().hex, group_id=group_id, env=env_name,
                       task_id=str(task.get("id", "")), started=time.time())
    t0 = time.monotonic()
    cast = Cast(client, ep, limits, roles or {}, baselines)  # used by a multi-agent environment only
    await client.begin(ep.episode_id, group_id=group_id, env=env_name)
    try:
        async with asyncio.timeout(limits.episode_timeout_s):
            await _episode_body(client, env_name, task, env_config or {}, sandbox_pool, limits, ep, cast)
    except TimeoutError:
        ep.truncated, ep.truncation = True, "timeout"
    except Exception as e:
        record_failure(ep, e)
    finally:
        ep.seconds = time.monotonic() - t0
        await cast.finish()
        await finish_samples(client, ep)
    return ep


async def finish_samples(client: ChatClient, ep: EpisodeResult,
                         summary: SessionSummary | None = None) -> SessionSummary | None:
    """Close the episode's session (unless ``summary`` says it is closed) and turn its records into
    samples, ahead of those already in ``ep.samples`` (a multi-agent episode's roles'); at least one
    sample: an episode with no model call gets an empty, flagged one so its group stays countable."""
    if summary is None:
        try:
            summary = await asyncio.shield(client.end(ep.episode_id))
        except (TransportError, RouterError) as e:  # the session's records are lost with serve's answer
            log.warning("could not close session %s: %s", ep.episode_id, e)
            if ep.error is None:
                ep.fail("transport", f"TransportError: could not close the session: {e}")
    if summary is not None:
        ep.splits = summary.splits
        ep.answer = ep.answer or summary.last_reply  # a scaffold's own answer, else the last reply
        ep.samples = [*episode_samples(summary, ep), *ep.samples]
    if not ep.samples:
        ep.samples = [Sample([], [], [], [], episode_id=ep.episode_id, group_id=ep.group_id, env=ep.env,
                             reward=0.0, truncated=ep.truncated, error=ep.error or "NoModelCall",
                             error_kind=ep.error_kind,
                             info={k: ep.info[k] for k in (POLICY_KEY, MIX_TAG) if ep.info.get(k)})]
    return summary


@contextlib.asynccontextmanager
async def episode_env(env_name: str, env_config: dict[str, Any],
                      sandbox_pool: SandboxPool | ImagePools | None, ep: EpisodeResult,
                      task: dict[str, Any] | None = None) -> AsyncIterator[Environment]:
    """The episode's environment, with its sandbox attached when it names an image; both are
    released on the way out, cancellation included. A failure to build one is EnvironmentFailure."""
    try:
        env = make(env_name, **env_config)
    except Exception as e:
        raise EnvironmentFailure(f"could not build {env_name!r}: {type(e).__name__}: {e}") from e
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(_close_env, env)
        await stack.enter_async_context(attached(env, sandbox_pool, task))  # the task may pick the image
        if env.sandbox is not None:
            ep.sandbox_id = env.sandbox.id
        yield env


async def _episode_body(client: ChatClient, env_name: str, task: dict[str, Any], env_config: dict[str, Any],
                        sandbox_pool: SandboxPool | ImagePools | None, limits: EpisodeLimits,
                        ep: EpisodeResult, cast: Cast) -> None:
    policy = str(task.get(POLICY_KEY) or "")  # a named LoRA policy plays the task (serve.policies)
    if policy:
        ep.info[POLICY_KEY] = policy
    if task.get(MIX_TAG):  # a mix's task: its environment, on the episode and its samples from the start
        ep.info[MIX_TAG] = str(task[MIX_TAG])
    async with episode_env(env_name, env_config, sandbox_pool, ep, task) as env:
        try:
            opening = await env.reset(task)
        except SandboxError:  # its sandbox's infrastructure failed, not the environment
            raise
        except Exception as e:
            raise EnvironmentFailure(f"reset raised {type(e).__name__}: {e}") from e
        messages = list(opening.messages)
        ep.info["tools"] = len(opening.tools)  # offered: with none ever called, nothing is learned about them
        if isinstance(env, MultiAgentEnv) and env.roles:  # (one with no roles plays as one agent)
            await cast.open(env.roles)
            await play_episode(env, task, cast)
            return
        if isinstance(env, PlayingEnv):
            await play_episode(env, task, SessionModel(client, ep, limits, policy))
            return
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
            # vLLM extensions, sent only when on (a plain OpenAI endpoint, as agentrl eval may use,
            # refuses them); off, they are off on the engines serve launches (engine.generation_config)
            if limits.top_k:
                body["top_k"] = limits.top_k
            if limits.min_p:
                body["min_p"] = limits.min_p
            if opening.tools:
                body["tools"] = opening.tools
            if policy:
                body["model"] = policy
            try:
                out = await client.chat(body, session_id=ep.episode_id)
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
            except SandboxError:  # its sandbox's infrastructure failed, not the environment
                raise
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
            if (
                out["choices"][0].get("finish_reason") == "length"
                and ep.completion_tokens >= limits.max_episode_tokens
            ):
                ep.truncated, ep.truncation = True, "max_tokens"
                return


async def play_episode(env: PlayingEnv, task: dict[str, Any], model: SessionModel | Cast) -> None:
    """Let ``env`` play (``reset`` was called with ``task``); record how it ended on ``model.ep``. A
    limit reached is a truncation, an engine failure behind a call keeps its kind, anything else the
    environment raised is its failure. (``agentrl envs try`` plays through here too.)"""
    ep = model.ep
    try:
        played = await env.play(task, model)
    except SandboxError:  # its sandbox's infrastructure failed, not the environment
        raise
    except Exception as e:
        if model.refused is not None:
            ep.truncated, ep.truncation = True, model.refused
            ep.info["play_error"] = f"{type(e).__name__}: {e}"[:2000]
            return
        if model.model_failure is not None:
            raise model.model_failure from e
        raise EnvironmentFailure(f"play raised {type(e).__name__}: {e}") from e
    if not isinstance(played, Played):
        raise EnvironmentFailure(f"play returned a {type(played).__name__}, not agentrl.env.base.Played")
    ep.reward = float(played.reward)
    ep.info.update(played.info)
    if played.sample_rewards is not None:
        ep.sample_rewards = {i: float(r) for i, r in enumerate(played.sample_rewards)}
    if played.role_rewards and isinstance(model, Cast):
        model.role_rewards = {str(k): float(v) for k, v in played.role_rewards.items()}
    if model.refused is not None:  # it caught the refusal and finished anyway: still cut short
        ep.truncated, ep.truncation = True, model.refused
    elif played.truncated:
        ep.truncated, ep.truncation = True, "env"
    else:
        ep.terminated = True


async def _close_env(env: Environment) -> None:
    try:
        await env.close()
    except Exception:
        log.warning("environment close() raised", exc_info=True)


@dataclass
class EpisodeLoop:
    """What the orchestrator's producers share: the model's client, the environment (name and
    config), the episode's limits and the sandbox pool. ``await loop(task, group_id)`` plays one
    episode and always returns its result (a failure is recorded on it, never raised)."""

    client: ChatClient
    env_name: str
    env_config: dict[str, Any]
    limits: EpisodeLimits
    sandbox_pool: SandboxPool | ImagePools | None = None
    roles: dict[str, RoleBinding] = field(default_factory=dict)  # a multi-agent environment's bindings
    baselines: RoleBaselines = field(default_factory=RoleBaselines)  # its roles' running baselines

    async def __call__(self, task: dict[str, Any], group_id: str) -> EpisodeResult:
        raise NotImplementedError


@dataclass
class BuiltinLoop(EpisodeLoop):
    """The orchestrator's producer for the built-in agent loop."""

    async def __call__(self, task: dict[str, Any], group_id: str) -> EpisodeResult:
        return await run_episode(
            self.client, self.env_name, task, group_id=group_id, env_config=self.env_config,
            sandbox_pool=self.sandbox_pool, limits=self.limits, roles=self.roles, baselines=self.baselines,
        )
