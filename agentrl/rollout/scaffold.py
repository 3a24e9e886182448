"""External scaffolds as rollout producers: someone else's agent program plays the episode.

For each episode the runner opens a router session with the episode's limits, builds the
environment (and its sandbox) and resets it, then starts the scaffold with the session's base URL
(``http://HOST:PORT/sessions/<id>/v1``) and key (``sess-<id>``). The scaffold is either

- an async Python callable ``async def agent(ctx: ScaffoldContext) -> str | None`` (run in the serve
  process, e.g. ``scaffolds.openai_minimal:agent``), or
- a command (:class:`CommandScaffold`), run on the host in its own process group with
  ``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL`` and ``AGENTRL_*`` variables set; its
  standard output is its answer.

Either way the scaffold only sees an OpenAI endpoint (and, where the environment has one, the
episode's sandbox to run commands in). Scaffolds run on the host, not inside the sandbox: sandbox
containers have no network, so a process in there could not reach the router; an agent that works
"in" the container executes its commands through the sandbox's exec API, as mini-swe-agent style
agents do anyway.

When the scaffold returns, the environment scores its answer (``env.reward(task, answer)``, or one
``env.step`` with the answer for environments without ``reward``); an answer of None means the
content of the session's last reply. Limits: the wall-clock limit cancels the callable or kills the
command's process group (``truncated``, ``timeout``); the turn and token limits are kept by the
router session, which refuses calls beyond them with a 400 (``truncated``, ``max_turns`` or
``max_tokens``); a scaffold that raises or exits non-zero gives an episode with
``error = "ScaffoldError: ..."``. Truncated and failed episodes are not scored (reward 0.0), and
their partial session still becomes samples, exactly as in the built-in loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import json
import logging
import os
import re
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import EnvironmentFailure, ScaffoldError
from agentrl.rollout.episode import (
    EpisodeLimits,
    EpisodeResult,
    episode_env,
    finish_samples,
)
from agentrl.router.core import Router, SessionLimits

log = logging.getLogger(__name__)

_CALLABLE_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_OUTPUT_LIMIT = 1 << 20  # bytes of a command scaffold's stdout/stderr kept


@dataclass
class ScaffoldContext:
    """What a scaffold gets for one episode: the task as chat messages and an OpenAI endpoint."""

    base_url: str  # http://HOST:PORT/sessions/<id>/v1: every call through it is recorded
    api_key: str  # sess-<id>
    model: str  # the served model name
    messages: list[dict[str, Any]]  # the environment's opening (system prompt, task)
    tools: list[dict[str, Any]] = field(default_factory=list)  # the environment's tool schemas, if any
    task: dict[str, Any] = field(default_factory=dict)
    sandbox: Any = None  # the episode's sandbox (exec/write_file/read_file), or None
    max_tokens: int = 128  # per model call (the router caps it anyway)
    temperature: float = 1.0

    @property
    def prompt(self) -> str:
        """The task's text: the last user message of the opening."""
        users = [m.get("content") or "" for m in self.messages if m.get("role") == "user"]
        return str(users[-1]) if users else ""

    @property
    def system(self) -> str:
        systems = [m.get("content") or "" for m in self.messages if m.get("role") == "system"]
        return str(systems[0]) if systems else ""

    def env_vars(self) -> dict[str, str]:
        """The variables a command scaffold is started with."""
        out = {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model,
               "AGENTRL_PROMPT": self.prompt, "AGENTRL_SYSTEM": self.system,
               "AGENTRL_MESSAGES": json.dumps(self.messages), "AGENTRL_TASK": json.dumps(self.task, default=str),
               "AGENTRL_MAX_TOKENS": str(self.max_tokens), "AGENTRL_TEMPERATURE": str(self.temperature)}
        if self.sandbox is not None:
            out["AGENTRL_SANDBOX_ID"] = str(self.sandbox.id)
        return out


Scaffold = Callable[[ScaffoldContext], Awaitable[str | None]]


@dataclass
class CommandScaffold:
    """A program run once per episode on the host; its stdout (stripped) is its answer.

    It runs in a new process group with the parent's environment plus :meth:`ScaffoldContext.env_vars`;
    when the episode is cancelled (wall-clock limit) the whole group is killed.
    """

    argv: list[str]
    cwd: str | None = None

    @property
    def name(self) -> str:
        return shlex.join(self.argv)

    async def __call__(self, ctx: ScaffoldContext) -> str | None:
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, **ctx.env_vars()}, cwd=self.cwd,
            start_new_session=True, limit=_OUTPUT_LIMIT)
        try:
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled (time limit) or failed while it runs
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await asyncio.shield(proc.wait())
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-1500:]
            raise ScaffoldError(f"{self.argv[0]} exited with {proc.returncode}: {tail}")
        text = out[-_OUTPUT_LIMIT:].decode(errors="replace").strip()
        return text or None


def load_scaffold(spec: str | Sequence[str]) -> Scaffold:
    """``"package.module:function"`` -> that async callable; anything else is a command line
    (a string is split like a shell would, ``{python}`` stands for this interpreter)."""
    if isinstance(spec, str) and _CALLABLE_SPEC.match(spec.strip()):
        module, _, attr = spec.strip().partition(":")
        try:
            obj: Any = importlib.import_module(module)
        except ImportError as e:
            raise ScaffoldError(f"cannot import scaffold module {module!r}: {e}") from e
        for part in attr.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise ScaffoldError(f"module {module!r} has no {attr!r}")
        if not callable(obj):
            raise ScaffoldError(f"scaffold {spec!r} is not callable")
        return obj
    argv = shlex.split(spec) if isinstance(spec, str) else [str(a) for a in spec]
    if not argv:
        raise ScaffoldError("empty scaffold command")
    return CommandScaffold([sys.executable if a == "{python}" else a for a in argv])


def scaffold_name(scaffold: Any) -> str:
    name = getattr(scaffold, "name", None)
    if isinstance(name, str):
        return name
    return f"{getattr(scaffold, '__module__', '?')}:{getattr(scaffold, '__qualname__', repr(scaffold))}"


async def run_scaffold_episode(router: Router, env_name: str, task: dict[str, Any], *, group_id: str,
                               scaffold: Scaffold, base_url: str, env_config: dict[str, Any] | None = None,
                               sandbox_pool: Any = None, limits: EpisodeLimits | None = None) -> EpisodeResult:
    """One episode played by ``scaffold`` through a router session at ``base_url`` (the router's
    address, e.g. ``http://127.0.0.1:8000``). Never raises for scaffold or environment failures."""
    limits = limits or EpisodeLimits()
    ep = EpisodeResult(episode_id=uuid.uuid4().hex, group_id=group_id, env=env_name,
                       task_id=str(task.get("id", "")), started=time.time())
    ep.info["scaffold"] = scaffold_name(scaffold)
    session_limits = SessionLimits(max_calls=limits.max_turns, max_tokens=limits.max_tokens,
                                   max_session_tokens=limits.max_episode_tokens)
    session = router.open_session(ep.episode_id, limits=session_limits, group_id=group_id, env=env_name,
                                  scaffold=ep.info["scaffold"])
    t0 = time.monotonic()
    try:
        async with episode_env(env_name, env_config or {}, sandbox_pool, ep) as env:
            try:
                opening = await env.reset(task)
            except Exception as e:
                raise EnvironmentFailure(f"reset raised {type(e).__name__}: {e}") from e
            ctx = ScaffoldContext(
                base_url=f"{base_url.rstrip('/')}/sessions/{ep.episode_id}/v1", api_key=f"sess-{ep.episode_id}",
                model=router.model_name, messages=list(opening.messages), tools=list(opening.tools), task=task,
                sandbox=getattr(env, "sandbox", None), max_tokens=limits.max_tokens,
                temperature=limits.temperature)
            answer, finished = await _play(scaffold, ctx, limits.timeout_s, session_limits, ep)
            if finished:
                if answer is None:
                    answer = _last_reply(session)
                ep.info["answer"] = answer[-2000:]
                ep.reward = await _score(env, task, answer, ep)
                ep.terminated = True
    except EnvironmentFailure as e:
        ep.error = f"EnvironmentError: {e}"
    except Exception as e:  # sandbox infrastructure and anything unforeseen: recorded, counted
        ep.error = f"{type(e).__name__}: {e}"
        log.warning("scaffold episode %s failed: %s", ep.episode_id, ep.error)
    finally:
        ep.turns = len(session.records)
        ep.completion_tokens = sum(len(c.token_ids) for r in session.records for c in r.completions)
        ep.versions = sorted({v for r in session.records for c in r.completions for v in c.versions})
        ep.seconds = time.monotonic() - t0
        finish_samples(router, ep)
    return ep


async def _play(scaffold: Scaffold, ctx: ScaffoldContext, timeout_s: float, lim: SessionLimits,
                ep: EpisodeResult) -> tuple[str | None, bool]:
    """Run the scaffold under the wall-clock limit; (answer, finished normally and within limits)."""
    try:
        async with asyncio.timeout(timeout_s):
            answer = await scaffold(ctx)
    except TimeoutError:
        ep.truncated, ep.truncation = True, "timeout"
        return None, False
    except Exception as e:
        if lim.refused:  # it stopped because the session refused a call: the limit, not a bug
            ep.truncated, ep.truncation = True, lim.refused
            ep.info["scaffold_error"] = f"{type(e).__name__}: {e}"[:2000]
        else:
            why = str(e) if isinstance(e, ScaffoldError) else f"{type(e).__name__}: {e}"
            ep.error = f"ScaffoldError: {why}"[:4000]
            log.info("scaffold %s failed in episode %s: %s", ep.info["scaffold"], ep.episode_id, ep.error)
        return None, False
    if lim.refused:  # it caught the refusal and returned: still truncated
        ep.truncated, ep.truncation = True, lim.refused
        return None, False
    if answer is not None and not isinstance(answer, str):
        answer = str(answer)
    return answer, True


def _last_reply(session: Any) -> str:
    for rec in reversed(session.records):
        for comp in rec.completions:
            content = (comp.message or {}).get("content")
            if content:
                return str(content)
    return ""


async def _score(env: Any, task: dict[str, Any], answer: str, ep: EpisodeResult) -> float:
    """The environment's verdict on the scaffold's outcome."""
    try:
        reward = getattr(env, "reward", None)
        if callable(reward):
            return float(await reward(task, answer))
        result = await env.step({"role": "assistant", "content": answer})
        ep.info.update(result.info)
        return float(result.reward)
    except Exception as e:
        raise EnvironmentFailure(f"scoring raised {type(e).__name__}: {e}") from e


def scaffold_producer(scaffold: Scaffold, base_url: str) -> Callable[..., Awaitable[EpisodeResult]]:
    """An ``episode_fn`` for the orchestrator: the same arguments as :func:`run_episode`."""
    return functools.partial(run_scaffold_episode, scaffold=scaffold, base_url=base_url)
