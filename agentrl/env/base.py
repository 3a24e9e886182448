"""The environment API: what users write.

Override in :class:`Environment`: ``tasks``, ``reset`` and ``step`` (and ``reward`` to score an
external scaffold's final answer another way than one ``step``). An environment whose own code
plays the episode (another ecosystem's rollout, a two-player game) subclasses
:class:`PlayingEnv` and implements ``play`` instead of ``step``: it gets a :class:`Model` whose
calls go through the episode's router session, so the tokens are recorded exactly. Most environments are tool
environments: subclass :class:`ToolEnv`, mark methods with ``@agentrl.tool``, implement
``prompt`` and ``reward``; the machinery turns the model's tool calls into tool messages.

An environment instance runs one episode at a time (one per episode); shared data belongs in the
task. A sandbox, when the class names an image, is attached by the rollout machinery before
``reset`` as ``self.sandbox`` and released after the episode, however it ends.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.env.tasks import load_tasks
from agentrl.env.tools import ToolCallError, call_tool, parse_arguments, parse_tool_calls, tool_schema
from agentrl.sandbox.types import SandboxError

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from agentrl.sandbox import Sandbox

log = logging.getLogger(__name__)

Message = dict[str, Any]

#: The key naming a task's environment in a run of several (environments/mix): what the scoring
#: stage picks a teacher by (``scoring.teachers``).
MIX_TAG = "mix_env"
#: The ``info`` key of an episode whose environment declares its success (an exact answer, a won
#: game), a bool: ``agentrl eval`` counts it instead of "reward above --success-reward", which
#: would count partial credit as solved.
SUCCESS_KEY = "success"


@dataclass
class Reset:
    """The opening of an episode: chat messages and the tools the model may call."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class StepResult:
    """What the environment answers to one assistant message."""

    messages: list[Message]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """Base class. Override ``tasks``, ``reset`` and ``step``; ``close`` is an optional hook."""

    #: Docker image of the sandbox this environment needs, or None for no sandbox.
    sandbox_image: str | None = None
    #: Set by the registry: the name this environment was registered under.
    env_name: str = ""

    sandbox: Sandbox | None = None

    @abstractmethod
    def tasks(self, split: str = "train") -> Iterable[dict[str, Any]]:
        """Task records for ``split`` ("train" or "test"); each one is passed to ``reset``."""

    @abstractmethod
    async def reset(self, task: dict[str, Any]) -> Reset:
        """Start an episode on ``task``."""

    @abstractmethod
    async def step(self, message: Message) -> StepResult:
        """Answer one assistant message (OpenAI format: content and/or tool_calls)."""

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        """Score a final plain-text ``answer`` to ``task`` (an external scaffold's outcome).

        Default: the environment's own verdict on one assistant message holding the answer
        (``step``'s reward); tool environments override it.
        """
        result = await self.step({"role": "assistant", "content": answer})
        return float(result.reward)

    async def close(self) -> None:  # noqa: B027 - an optional hook, empty on purpose
        """Hook: release what the episode held (the sandbox is released by the machinery)."""


class Model(Protocol):
    """The policy as a :class:`PlayingEnv` reaches it: chat completions through the episode's session.

    ``chat`` takes an OpenAI chat-completion body and returns the response as a dict; the episode's
    limits apply (its sampling temperature and top_p, ``max_tokens`` capped by the per-call and
    per-episode budgets; a call beyond ``max_turns`` raises). Code that needs an OpenAI base URL
    instead wraps it in :func:`agentrl.env.adapters.relay.serve_model` (a loopback endpoint).
    """

    name: str  # the served model's name
    max_tokens: int  # completion tokens per call
    temperature: float

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]: ...


@dataclass
class Played:
    """How a :class:`PlayingEnv`'s episode ended.

    ``sample_rewards``: the reward of each model call's sample, in call order (the calls of one
    player in a two-player game chain into that player's sample, which gets that player's reward);
    None gives every sample ``reward``. ``role_rewards`` (a multi-agent environment,
    :class:`agentrl.env.roles.MultiAgentEnv`): each role's reward, which its samples get (a role
    left out gets ``reward``, the episode's team reward); a role the environment does not declare
    fails the episode.
    """

    reward: float
    sample_rewards: list[float] | None = None
    role_rewards: dict[str, float] | None = None
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class PlayingEnv(Environment):
    """An environment whose own code plays each episode against :class:`Model` (override ``play``).

    ``reset`` still returns the opening as the model first sees it (for ``agentrl envs show`` and the
    episode record); the agent loop then calls ``play`` instead of alternating model calls and
    ``step``. Whatever ``play`` raises fails the episode as an environment error, except the
    model's own failures, which keep their kind.
    """

    @abstractmethod
    async def play(self, task: dict[str, Any], model: Model) -> Played:
        """Play one episode of ``task`` (``reset`` was called with it) and score it."""

    async def step(self, message: Message) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} plays its own episodes (play), it has no step")


class ToolEnv(Environment):
    """An environment whose model acts through tools and ends by answering in plain text.

    Override ``tasks``, ``prompt`` and ``reward``; mark tool methods with ``@agentrl.tool``.
    The episode ends when the model answers without a tool call (``reward`` scores it) or when
    ``max_turns`` assistant messages were produced (truncated, still scored).
    """

    system_prompt: str = ""
    max_turns: int = 6

    def __init__(self) -> None:
        self._tool_names = _tool_names(type(self))
        self.task: dict[str, Any] = {}
        self.messages: list[Message] = []
        self.turns = 0
        self.tool_errors: dict[str, int] = {}
        self.tool_calls = 0

    @property
    def _tools(self) -> dict[str, Callable]:
        """The tools, bound now: bound methods kept on the instance would make every episode's
        environment a reference cycle, left for the cyclic collector (whose passes over thousands of
        live episodes are what stalls the event loop; see agentrl.serve.collector)."""
        return {name: getattr(self, name) for name in self._tool_names}

    # -- override these ---------------------------------------------------------------------
    def prompt(self, task: dict[str, Any]) -> str:
        """The user message that opens the episode."""
        return str(task["question"])

    @abstractmethod
    async def reward(self, task: dict[str, Any], answer: str) -> float:
        """Score the model's final plain-text answer."""

    # -- machinery ----------------------------------------------------------------------------
    async def reset(self, task: dict[str, Any]) -> Reset:
        self.task = task
        self.turns = 0
        self.tool_calls = 0
        self.tool_errors = {}
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": self.prompt(task)})
        self.messages = list(messages)
        return Reset(messages=messages, tools=[tool_schema(fn) for fn in self._tools.values()])

    async def step(self, message: Message) -> StepResult:
        self.turns += 1
        self.messages.append(message)
        calls = message.get("tool_calls") or []
        content = message.get("content") or ""
        info = {"tool_calls": self.tool_calls, "tool_errors": dict(self.tool_errors)}
        if not calls and "<tool_call>" in content:
            # No engine-side parser ran, or it rejected the reply: read it ourselves. Valid calls
            # run; a malformed one is explained to the model and counted, never an exception.
            parsed = parse_tool_calls(content, id_prefix=f"call_t{self.turns}")
            if parsed.errors:
                for err in parsed.errors:
                    self._count_error(err.kind)
                text = "; ".join(e.message for e in parsed.errors)
                obs = [{"role": "user", "content": f"Error: your tool call could not be read: {text}"}]
                return self._continue(obs, info)
            calls = parsed.tool_calls
        if not calls:
            reward = await self.reward(self.task, content)
            return StepResult(messages=[], reward=reward, terminated=True, info=info)
        observations = [await self._run_call(call) for call in calls]
        return self._continue(observations, info)

    def _continue(self, observations: list[Message], info: dict[str, Any]) -> StepResult:
        self.messages.extend(observations)
        info.update(tool_calls=self.tool_calls, tool_errors=dict(self.tool_errors))
        if self.turns >= self.max_turns:
            return StepResult(messages=observations, reward=0.0, truncated=True, info=info)
        return StepResult(messages=observations, info=info)

    def _count_error(self, kind: str) -> None:
        self.tool_errors[kind] = self.tool_errors.get(kind, 0) + 1

    async def _run_call(self, call: dict[str, Any]) -> Message:
        self.tool_calls += 1
        fn_part = call.get("function") or {}
        name = fn_part.get("name", "")
        result: str
        fn = self._tools.get(name)
        if fn is None:
            err: ToolCallError | dict = ToolCallError(
                "unknown_tool", f"unknown tool {name!r}; available: {sorted(self._tools)}"
            )
        else:
            err = parse_arguments(fn, fn_part.get("arguments"))
        if isinstance(err, ToolCallError):
            self._count_error(err.kind)
            result = f"Error: {err.message}"
        else:
            try:
                result = await call_tool(fn, err)
            except SandboxError:  # the sandbox's infrastructure failed, not the tool: the episode fails
                raise
            except Exception as e:  # a tool that raises is the model's problem, not the server's
                self._count_error("tool_raised")
                log.debug("tool %s raised", name, exc_info=True)
                result = f"Error: tool {name} failed: {type(e).__name__}: {e}"
        return {"role": "tool", "tool_call_id": call.get("id", ""), "content": result}


class TaskListEnv(ToolEnv):
    """A :class:`ToolEnv` over one list of tasks for every split: the class's ``TASKS``, or what a
    config gives as ``tasks`` instead (anything :func:`~agentrl.env.tasks.load_tasks` reads: a
    list of dicts, a ``.jsonl`` path, ``"hf:NAME"``). ``timeout_s`` bounds each sandboxed command;
    the class attribute is the default a config's ``timeout_s`` replaces."""

    TASKS: str | Path | Iterable[Mapping[str, Any]] = ()
    timeout_s: float = 10.0

    def __init__(self, tasks: str | Path | Iterable[Mapping[str, Any]] | None = None,
                 timeout_s: float | None = None) -> None:
        super().__init__()
        self.source = load_tasks(self.TASKS if tasks is None else tasks)
        if timeout_s is not None:
            self.timeout_s = timeout_s

    def tasks(self, split: str = "train") -> Iterable[dict[str, Any]]:
        return iter(self.source)


@functools.cache
def _tool_names(cls: type) -> tuple[str, ...]:
    """Names of a class's ``@tool`` methods, found once per class (not once per episode)."""
    return tuple(name for name in dir(cls) if getattr(getattr(cls, name, None), "__agentrl_tool__", False))
