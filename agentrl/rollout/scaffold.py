"""External scaffolds as rollout producers: someone else's agent program plays the episode.

For each episode the runner opens a router session with the episode's limits, builds the
environment (and its sandbox) and resets it, then starts the scaffold with the session's base URL
(``http://HOST:PORT/sessions/<id>/v1``) and key (``sess-<id>``). The scaffold is either

- an async Python callable ``async def agent(ctx: ScaffoldContext) -> str | None`` (run in the serve
  process, e.g. ``scaffolds.openai_minimal:agent``), or
- a command (:class:`CommandScaffold`), run on the host in its own process group with
  ``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL`` and ``AGENTRL_*`` variables set; its
  standard output is its answer.

With ``env.roles`` the program's agents are roles, each with its own endpoint and router session
(``ScaffoldContext.roles``, ``AGENTRL_ROLE_<ROLE>_BASE_URL``; :mod:`agentrl.rollout.scaffold_roles`).

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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.errors import EnvironmentFailure, ScaffoldError
from agentrl.rollout.config import EpisodeLimits
from agentrl.rollout.episode import EpisodeLoop, EpisodeResult, episode_env, finish_samples, record_failure
from agentrl.rollout.protocols import ChatClient
from agentrl.rollout.roles import RoleBaselines
from agentrl.rollout.scaffold_roles import RoleEndpoint, ScaffoldRoles
from agentrl.router.session_store import SessionLimits
from agentrl.router.sessions import SessionSummary

if TYPE_CHECKING:
    from agentrl.env.base import Environment
    from agentrl.rollout.config import RoleBinding
    from agentrl.sandbox.attach import ImagePools
    from agentrl.sandbox.handle import Sandbox
    from agentrl.sandbox.pool import SandboxPool

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
    sandbox: Sandbox | None = None  # the episode's sandbox (exec/write_file/read_file), or None
    max_tokens: int = 128  # per model call (the router caps it anyway)
    temperature: float = 1.0
    roles: dict[str, RoleEndpoint] = field(default_factory=dict)
    """with ``env.roles``: each role's own endpoint (its calls sample the role's binding and train its
    policy); ``base_url`` is then the first role's. Empty without roles."""

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
        """The variables a command scaffold is given for its episode: its endpoint and the task as the
        model sees it (never the task record, which holds the answer)."""
        out = {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model,
               "AGENTRL_PROMPT": self.prompt, "AGENTRL_SYSTEM": self.system,
               "AGENTRL_MESSAGES": json.dumps(self.messages), "AGENTRL_TOOLS": json.dumps(self.tools),
               "AGENTRL_MAX_TOKENS": str(self.max_tokens), "AGENTRL_TEMPERATURE": str(self.temperature)}
        if self.sandbox is not None:
            out["AGENTRL_SANDBOX_ID"] = str(self.sandbox.id)
        if self.roles:
            out["AGENTRL_ROLES"] = ",".join(self.roles)
        for role, where in self.roles.items():
            out.update({f"AGENTRL_ROLE_{role.upper()}_BASE_URL": where.base_url,
                        f"AGENTRL_ROLE_{role.upper()}_API_KEY": where.api_key,
                        f"AGENTRL_ROLE_{role.upper()}_MODEL": where.model})
        return out


Scaffold = Callable[[ScaffoldContext], Awaitable[str | None]]

# what any program needs from the host to start and find its libraries; nothing that is a secret
HOST_VARS = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TERM", "TZ",
    "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "SSL_CERT_FILE", "SSL_CERT_DIR", "DOCKER_HOST",
)


def scrubbed_env(ctx: ScaffoldContext, passthrough: Sequence[str] = ()) -> dict[str, str]:
    """A command scaffold's environment: :data:`HOST_VARS` and ``passthrough`` from serve's, then the
    episode's own variables (which win)."""
    keep = set(HOST_VARS) | set(passthrough)
    return {**{k: v for k, v in os.environ.items() if k in keep}, **ctx.env_vars()}


@dataclass
class CommandScaffold:
    """A program run once per episode on the host; its stdout (stripped) is its answer.

    It runs in a new process group with a scrubbed environment: the few variables a program needs
    to run (:data:`HOST_VARS`, e.g. PATH and HOME), those named in ``passthrough``, and
    :meth:`ScaffoldContext.env_vars`; nothing else of serve's (no admin token, no API keys, no task
    record with its answer). When the episode is cancelled (wall-clock limit) the whole group is killed.
    """

    argv: list[str]
    cwd: str | None = None
    passthrough: tuple[str, ...] = ()  # more of serve's variables the program may see (scaffold.env)

    @property
    def name(self) -> str:
        return shlex.join(self.argv)

    async def __call__(self, ctx: ScaffoldContext) -> str | None:
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=scrubbed_env(ctx, self.passthrough), cwd=self.cwd,
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


def load_scaffold(spec: str | Sequence[str], passthrough: Sequence[str] = ()) -> Scaffold:
    """``"package.module:function"`` -> that async callable; anything else is a command line
    (a string is split like a shell would, ``{python}`` stands for this interpreter) run with
    a scrubbed environment plus the variables named in ``passthrough``."""
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
    return CommandScaffold(
        [sys.executable if a == "{python}" else a for a in argv], passthrough=tuple(passthrough)
    )


def scaffold_name(scaffold: Scaffold) -> str:
    name = getattr(scaffold, "name", None)
    if isinstance(name, str):
        return name
    return f"{getattr(scaffold, '__module__', '?')}:{getattr(scaffold, '__qualname__', repr(scaffold))}"


async def run_scaffold_episode(
    client: ChatClient, env_name: str, task: dict[str, Any], *, group_id: str, scaffold: Scaffold,
    base_url: str, env_config: dict[str, Any] | None = None,
    sandbox_pool: SandboxPool | ImagePools | None = None, limits: EpisodeLimits | None = None,
    roles: Mapping[str, RoleBinding] | None = None, baselines: RoleBaselines | None = None,
) -> EpisodeResult:
    """One episode played by ``scaffold`` through a router session at ``base_url`` (the router's
    address, e.g. ``http://127.0.0.1:8000``). Never raises for scaffold or environment failures.
    ``roles`` (``env.roles``): the program's agents, one session each
    (:mod:`agentrl.rollout.scaffold_roles`) instead of the episode's one.

    A scaffold that fails after the router could not serve one of its calls (no engine, an engine
    error) is recorded as a model failure, not as the scaffold's: the outage is the likely cause,
    and the orchestrator backs off on it as it does for the built-in loop."""
    limits = limits or EpisodeLimits()
    ep = EpisodeResult(episode_id=uuid.uuid4().hex, group_id=group_id, env=env_name,
                       task_id=str(task.get("id", "")), started=time.time())
    ep.info["scaffold"] = scaffold_name(scaffold)
    session_limits = SessionLimits(max_calls=limits.max_turns, max_tokens=limits.max_tokens,
                                   max_session_tokens=limits.max_episode_tokens)
    cast = ScaffoldRoles(client, ep, roles, session_limits, baselines) if roles else None
    if cast is None:
        await client.begin(ep.episode_id, limits=session_limits, group_id=group_id, env=env_name,
                           scaffold=ep.info["scaffold"])
    t0 = time.monotonic()
    summary: SessionSummary | None = None
    try:
        sid = ep.episode_id
        where = await cast.open(base_url) if cast is not None else {"": RoleEndpoint(
            f"{base_url.rstrip('/')}/sessions/{sid}/v1", f"sess-{sid}", client.model_name)}
        first = next(iter(where.values()))
        async with episode_env(env_name, env_config or {}, sandbox_pool, ep, task) as env:
            try:
                opening = await env.reset(task)
            except Exception as e:
                raise EnvironmentFailure(f"reset raised {type(e).__name__}: {e}") from e
            ctx = ScaffoldContext(
                base_url=first.base_url, api_key=first.api_key, model=first.model,
                messages=list(opening.messages), tools=list(opening.tools), task=task, sandbox=env.sandbox,
                max_tokens=limits.max_tokens, temperature=limits.temperature,
                roles=where if cast is not None else {},
            )
            outcome, answer = await _play(scaffold, ctx, limits.episode_timeout_s)
            # what the session (or the role sessions) spent decides how it ended
            summary = await cast.end() if cast is not None else await client.end(ep.episode_id)
            if _settle(outcome, answer, summary, ep):
                answer = answer if answer is not None else (summary.last_reply if summary else "")
                ep.info["answer"] = answer[-2000:]
                ep.reward = await _score(env, task, answer)
                ep.answer = answer
                ep.terminated = True
    except Exception as e:
        record_failure(ep, e)
    finally:
        ep.seconds = time.monotonic() - t0
        if cast is not None:
            await cast.finish()
        summary = await finish_samples(client, ep, summary)
        if summary is not None:
            ep.turns, ep.completion_tokens, ep.versions = (
                summary.calls, summary.completion_tokens, summary.versions,
            )
    return ep


async def _play(scaffold: Scaffold, ctx: ScaffoldContext,
                timeout_s: float) -> tuple[str | Exception, str | None]:
    """Run the scaffold under the wall-clock limit: ("done", answer), ("timeout", None) or (the exception,
    None)."""
    try:
        async with asyncio.timeout(timeout_s):
            answer = await scaffold(ctx)
    except TimeoutError:
        return "timeout", None
    except Exception as e:
        return e, None
    return "done", answer if answer is None or isinstance(answer, str) else str(answer)


def _settle(outcome: str | BaseException, answer: str | None, summary: SessionSummary | None,
            ep: EpisodeResult) -> bool:
    """Record how the scaffold's run ended; True when it finished within its limits (then it is scored)."""
    refused = summary.refused if summary is not None else None
    if outcome == "timeout":
        ep.truncated, ep.truncation = True, "timeout"
        return False
    if isinstance(outcome, BaseException):
        e = outcome
        if refused:  # it stopped because the session refused a call: the limit, not a bug
            ep.truncated, ep.truncation = True, refused
            ep.info["scaffold_error"] = f"{type(e).__name__}: {e}"[:2000]
        elif summary is not None and summary.model_failures:  # the router could not serve it
            ep.fail("model", f"ModelError: the scaffold failed after {summary.model_failures} model call(s) "
                             f"failed: {type(e).__name__}: {e}"[:4000])
        else:
            why = str(e) if isinstance(e, ScaffoldError) else f"{type(e).__name__}: {e}"
            ep.fail("scaffold", f"ScaffoldError: {why}"[:4000])
            log.info("scaffold %s failed in episode %s: %s", ep.info["scaffold"], ep.episode_id, ep.error)
        return False
    if refused:  # it caught the refusal and returned: still truncated
        ep.truncated, ep.truncation = True, refused
        return False
    return True


async def _score(env: Environment, task: dict[str, Any], answer: str) -> float:
    """The environment's verdict on the scaffold's outcome (its ``reward``)."""
    try:
        return float(await env.reward(task, answer))
    except Exception as e:
        raise EnvironmentFailure(f"scoring raised {type(e).__name__}: {e}") from e


@dataclass
class ScaffoldLoop(EpisodeLoop):
    """The orchestrator's producer for an external scaffold."""

    scaffold: Scaffold = field(kw_only=True)
    base_url: str = field(kw_only=True)
    """the router's address as the scaffold reaches it, e.g. http://127.0.0.1:8000"""

    async def __call__(self, task: dict[str, Any], group_id: str) -> EpisodeResult:
        return await run_scaffold_episode(
            self.client, self.env_name, task, group_id=group_id, scaffold=self.scaffold,
            base_url=self.base_url, env_config=self.env_config, sandbox_pool=self.sandbox_pool,
            limits=self.limits, roles=self.roles, baselines=self.baselines,
        )
