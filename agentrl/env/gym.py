"""gymnasium in both directions: agentrl environments as ``gymnasium.Env``, and text gym envs as agentrl.

:class:`GymEnv` wraps any agentrl environment (an instance or a registered name) as a synchronous
``gymnasium.Env`` whose observation and action spaces are text. ``reset`` opens an episode on the
next task (or ``options={"task": {...}}``) and returns the opening messages rendered as text;
``step(text)`` reads hermes-style ``<tool_call>`` blocks out of the text (as an engine's tool parser
would), hands the assistant message to the environment and returns the observation messages as
text. The structured messages and tools are always in ``info`` for agents that want them. The
wrapper owns a private event loop, so it must not be called from inside a running one.

:class:`GymAdapter` runs a text-based ``gymnasium.Env`` as an agentrl environment: each task is a
seed (and optional reset options), observations become user messages, the assistant's text is the
action. :func:`register_gym` registers one under an agentrl name.

Invariants: rewards, ``terminated`` and ``truncated`` pass through unchanged both ways; a reset
seed makes the wrapper's task stream (and so its first observation) reproducible.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import string
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import gymnasium
from gymnasium import spaces

from agentrl.env.base import Environment, Message, Reset, StepResult
from agentrl.env.registry import environment, make
from agentrl.env.tools import parse_tool_calls

if TYPE_CHECKING:
    from agentrl.sandbox.attach import ImagePools
    from agentrl.sandbox.pool import SandboxPool
    from agentrl.sandbox.types import SandboxConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class TextSpace(spaces.Text):
    """A text space that contains any ``str`` up to ``max_length`` characters (any Unicode).

    ``gymnasium.spaces.Text`` only contains strings over its charset (alphanumerics by default);
    model output and tool results are arbitrary text. Samples are drawn from printable ASCII.
    """

    def __init__(self, max_length: int = 1 << 16, *, seed: int | None = None) -> None:
        super().__init__(max_length=max_length, min_length=0, charset=string.printable, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length


def render_messages(messages: list[Message]) -> str:
    """Chat messages as plain text: ``[role]`` headers, contents, and tool calls as hermes blocks."""
    parts = []
    for m in messages:
        body = m.get("content") or ""
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            body += (f"\n<tool_call>\n{{\"name\": \"{fn.get('name')}\", "
                     f"\"arguments\": {fn.get('arguments')}}}\n</tool_call>")
        parts.append(f"[{m.get('role', 'user')}]\n{body.strip()}")
    return "\n\n".join(parts)


def text_to_message(text: str) -> Message:
    """An assistant message from raw model text, with tool calls parsed when they are all valid."""
    parsed = parse_tool_calls(text)
    if parsed.tool_calls and not parsed.errors:
        return {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
    return {"role": "assistant", "content": text}  # malformed calls: the environment explains them


class GymEnv(gymnasium.Env):
    """Any agentrl environment as a ``gymnasium.Env`` with text observations and actions.

    Args:
        env: an agentrl environment instance, or a registered name (built with ``env_config``).
        tasks: the tasks ``reset`` draws in order (default: ``env.tasks(split)``); ``reset(seed=s)``
            restarts the stream at task ``s`` so that a seed names a task.
        sandbox_config: a ``SandboxConfig`` for environments that need a sandbox; one sandbox is
            acquired per episode from a pool the wrapper owns.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, env: Environment | str, tasks: Iterable[dict[str, Any]] | None = None, *,
                 split: str = "train", env_config: dict[str, Any] | None = None,
                 sandbox_config: SandboxConfig | None = None, max_length: int = 1 << 16,
                 render_mode: str | None = None) -> None:
        self.env: Environment = make(env, **(env_config or {})) if isinstance(env, str) else env
        # A callable, so every restart gets a fresh stream (env.tasks() is usually a generator).
        self._task_source: Callable[[], Iterable[dict[str, Any]]] = (
            (lambda: tasks) if tasks is not None else (lambda: self.env.tasks(split)))
        self._tasks: Iterator[dict[str, Any]] | None = None
        self.observation_space = TextSpace(max_length)
        self.action_space = TextSpace(max_length)
        self.render_mode = render_mode
        self._sandbox_config = sandbox_config
        self._runner = asyncio.Runner()
        self._pool: SandboxPool | ImagePools | None = None
        self._episode: contextlib.AsyncExitStack | None = None
        self.task: dict[str, Any] | None = None
        self.messages: list[Message] = []
        self.tools: list[dict[str, Any]] = []

    def _next_task(self, seed: int | None) -> dict[str, Any]:
        if self._tasks is None or seed is not None:
            self._tasks = iter(self._task_source())
            if seed is not None:
                self._tasks = itertools.islice(self._tasks, seed, None)
        try:
            return next(self._tasks)
        except StopIteration:
            self._tasks = iter(self._task_source())  # the stream wraps around
            try:
                return next(self._tasks)
            except StopIteration:
                raise ValueError("the task source is empty") from None

    async def _open(self, task: dict[str, Any]) -> Reset:
        if self._episode is not None:
            await self._episode.aclose()
        self._episode = contextlib.AsyncExitStack()
        self.env.sandbox = None
        if self.env.sandbox_image and self._pool is None:
            if self._sandbox_config is None:
                raise ValueError(f"{type(self.env).__name__} needs a sandbox: "
                                 "pass sandbox_config=SandboxConfig(...)")
            from agentrl.sandbox.attach import pool_for

            self._pool = await pool_for(self.env.sandbox_image, self._sandbox_config, f"gym-{id(self):x}")
        from agentrl.sandbox.attach import attached

        await self._episode.enter_async_context(attached(self.env, self._pool))
        return await self.env.reset(task)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        self.task = options["task"] if "task" in options else self._next_task(seed)
        opening = self._runner.run(self._open(self.task))
        self.messages = list(opening.messages)
        self.tools = opening.tools
        info = {"task": self.task, "messages": opening.messages, "tools": opening.tools}
        return render_messages(opening.messages), info

    def step(self, action: str | Message) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.task is None:
            raise RuntimeError("call reset() before step()")
        message = action if isinstance(action, dict) else text_to_message(str(action))
        result: StepResult = self._runner.run(self.env.step(message))
        self.messages += [message, *result.messages]
        info = dict(result.info, messages=result.messages)
        return (
            render_messages(result.messages),
            float(result.reward),
            result.terminated,
            result.truncated,
            info,
        )

    def render(self) -> str | None:
        return render_messages(self.messages) if self.render_mode == "ansi" else None

    def close(self) -> None:
        async def shut() -> None:
            if self._episode is not None:
                await self._episode.aclose()
            await self.env.close()
            if self._pool is not None:
                await self._pool.close()

        try:
            self._runner.run(shut())
        finally:
            self._runner.close()
        super().close()


class GymAdapter(Environment):
    """A text-based ``gymnasium.Env`` as an agentrl environment.

    Args:
        gym_env: an env instance, a ``gymnasium.make`` id, or a zero-argument factory.
        system_prompt: the opening system message (rules of the game for the model).
        num_train / num_test: how many tasks (seeds) each split yields; test seeds are disjoint.
        observation_to_text / text_to_action: conversions for envs whose spaces are not plain text.
        in_thread: run the gym env's ``reset``/``step`` in a worker thread (for slow envs), so the
            event loop running thousands of episodes is never blocked by one.
    """

    def __init__(self, gym_env: gymnasium.Env | str | Callable[[], gymnasium.Env], *, system_prompt: str = "",
                 num_train: int = 10_000, num_test: int = 100,
                 observation_to_text: Callable[[Any], str] = str,
                 text_to_action: Callable[[str], Any] | None = None, in_thread: bool = False,
                 **make_kwargs: Any) -> None:
        if isinstance(gym_env, str):
            gym_env = gymnasium.make(gym_env, **make_kwargs)
        elif not isinstance(gym_env, gymnasium.Env):
            gym_env = gym_env()
        self.gym_env: gymnasium.Env = gym_env
        if text_to_action is None and not isinstance(gym_env.action_space, spaces.Text):
            raise TypeError(f"{gym_env} has action space {gym_env.action_space}, not Text; pass "
                            f"text_to_action= to turn the model's reply into an action")
        self.system_prompt = system_prompt
        self.num_train, self.num_test = num_train, num_test
        self.observation_to_text = observation_to_text
        self.text_to_action = text_to_action or (lambda text: text)
        self.in_thread = in_thread

    def tasks(self, split: str = "train") -> Iterator[dict[str, Any]]:
        offset, n = (0, self.num_train) if split == "train" else (1 << 30, self.num_test)
        for i in range(n):
            yield {"id": f"{split}-{i}", "seed": offset + i}

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs) if self.in_thread else fn(*args, **kwargs)

    async def reset(self, task: dict[str, Any]) -> Reset:
        obs, _info = await self._call(self.gym_env.reset, seed=task.get("seed"), options=task.get("options"))
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": self.observation_to_text(obs)})
        return Reset(messages=messages)

    async def step(self, message: Message) -> StepResult:
        action = self.text_to_action(message.get("content") or "")
        obs, reward, terminated, truncated, info = await self._call(self.gym_env.step, action)
        text = self.observation_to_text(obs)
        messages = [{"role": "user", "content": text}] if text and not (terminated or truncated) else []
        return StepResult(messages=messages, reward=float(reward), terminated=bool(terminated),
                          truncated=bool(truncated), info={k: v for k, v in info.items() if _jsonable(v)})

    async def close(self) -> None:
        await self._call(self.gym_env.close)


def _jsonable(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None), list, dict))


def register_gym(name: str, gym_env: str | Callable[[], gymnasium.Env], **adapter_kwargs: Any) -> None:
    """Register a text gymnasium env (an id or a factory) as the agentrl environment ``name``."""

    def factory(**config: Any) -> GymAdapter:
        return GymAdapter(gym_env, **{**adapter_kwargs, **config})

    factory.__doc__ = ("gymnasium env "
                       f"{gym_env if isinstance(gym_env, str) else getattr(gym_env, '__name__', gym_env)}")
    factory.__qualname__ = factory.__name__ = f"gym_{name}"
    environment(name)(factory)
