"""``agentrl eval``: success rate and reward of a model on an environment's held-out tasks.

Episodes run through the built-in agent loop (:func:`agentrl.rollout.episode.run_episode`), the
same code that produces training data, against any OpenAI-compatible endpoint: serve's router
(``http://HOST:8000/v1``), a vLLM server, or a hosted API. Over HTTP nothing is recorded for
training (no session is opened), so evaluation never feeds the buffer. An in-process
:class:`~agentrl.router.core.Router` works too (``endpoint=router``).

Success of an episode: the environment ended it (terminated, not truncated, no error) and declared
it a success (``info["success"]``, :data:`~agentrl.env.base.SUCCESS_KEY`: an exact answer, a won
game); an environment that declares nothing is judged by its total reward, above
``success_reward`` (default 0). Partial credit is never a success where the environment says what
success is: the mean reward reports it beside. The result carries a 95% Wilson score interval for
the success rate and a normal-approximation interval for the mean reward, so two evaluations
(before and after training) can be compared honestly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.env.base import MIX_TAG, SUCCESS_KEY
from agentrl.env.roles import ROLE_SUCCESS_KEY
from agentrl.rollout.config import EpisodeLimits, RoleBinding
from agentrl.rollout.episode import is_success
from agentrl.rollout.remote import OpenAIChat
from agentrl.router.errors import RouterError
from agentrl.sandbox.types import SandboxConfig

if TYPE_CHECKING:
    from collections.abc import Mapping

    from agentrl.rollout.episode import EpisodeResult
    from agentrl.rollout.protocols import ChatClient
    from agentrl.sandbox.attach import ImagePools
    from agentrl.sandbox.pool import SandboxPool

log = logging.getLogger(__name__)

SPLIT_ALIASES = {"heldout": "test", "held-out": "test", "eval": "test", "test": "test", "train": "train"}


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (95% for z = 1.96); (0, 1) when n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean and its normal-approximation interval (mean +- z * sd / sqrt(n))."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0, 0.0
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = z * sd / math.sqrt(n)
    return mean, mean - half, mean + half


@dataclass
class EvalResult:
    env: str
    split: str
    endpoint: str
    model: str
    n: int
    successes: int
    success_rate: float
    success_ci95: tuple[float, float]
    reward_mean: float
    reward_ci95: tuple[float, float]
    failed: int  # episodes that ended in an error (model, environment, sandbox)
    truncated: int
    turns_mean: float
    seconds: float
    temperature: float
    declared: int = 0  # episodes whose environment declared their success; the others: reward > threshold
    episodes: list[dict[str, Any]] = field(default_factory=list)
    # a mix's tasks (each names its environment under ``mix_env``): the same figures per environment,
    # {name: {n, successes, success_rate, success_ci95, reward_mean, reward_ci95}}; empty otherwise
    by_env: dict[str, dict[str, Any]] = field(default_factory=dict)
    # a multi-agent environment that declares each role's success (``info["role_success"]``): the
    # same figures per role (its reward: the role's own); empty otherwise
    by_role: dict[str, dict[str, Any]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Everything but the per-episode list (one JSON line)."""
        return {k: v for k, v in asdict(self).items() if k != "episodes"}

    def line(self) -> str:
        lo, hi = self.success_ci95
        rlo, rhi = self.reward_ci95
        judged = {self.n: "declared by the environment", 0: "reward above the threshold"}.get(
            self.declared, f"declared for {self.declared}, the rest by reward")
        out = (f"{self.env} [{self.split}] {self.n} tasks: success {self.success_rate:.1%} "
               f"(95% CI {lo:.1%}-{hi:.1%}; {judged}) | mean reward {self.reward_mean:.3f} (95% "
               f"CI {rlo:.3f}-{rhi:.3f}) | failed {self.failed} truncated {self.truncated} "
               f"| mean turns {self.turns_mean:.2f} | {self.seconds:.1f} s")
        for name, e in [*self.by_env.items(), *((f"role {r}", e) for r, e in self.by_role.items())]:
            lo, hi = e["success_ci95"]
            out += f"\n  {name}: {e['n']} tasks, success {e['success_rate']:.1%} (95% CI {lo:.1%}-{hi:.1%})"
        return out


def tally(wins: list[bool], rewards: list[float]) -> dict[str, Any]:
    """Success and reward of a set of episodes, each with its 95% interval (:class:`EvalResult`'s
    fields of the same names)."""
    n = len(wins)
    reward_mean, rlo, rhi = mean_interval(rewards)
    return {
        "n": n,
        "successes": sum(wins),
        "success_rate": sum(wins) / n if n else 0.0,
        "success_ci95": wilson_interval(sum(wins), n),
        "reward_mean": reward_mean,
        "reward_ci95": (rlo, rhi),
    }


def tally_by_env(
    tasks: list[dict[str, Any]], wins: list[bool], rewards: list[float]
) -> dict[str, dict[str, Any]]:
    """:func:`tally` per environment of a mix's tasks (by their ``mix_env``), in the order they first
    appear; empty when no task names one (a single environment's evaluation)."""
    groups: dict[str, list[int]] = {}
    for i, task in enumerate(tasks):
        if task.get(MIX_TAG):
            groups.setdefault(str(task[MIX_TAG]), []).append(i)
    return {name: tally([wins[i] for i in idx], [rewards[i] for i in idx]) for name, idx in groups.items()}


def tally_by_role(episodes: list[EpisodeResult]) -> dict[str, dict[str, Any]]:
    """:func:`tally` per role of a multi-agent environment's episodes, from the roles' declared
    success (``info["role_success"]``) and rewards (``info["role_rewards"]``); an episode that failed
    or was cut short counts as a failure of every role. Empty when no episode declares any."""
    roles: list[str] = []
    for ep in episodes:
        roles += [r for r in ep.info.get(ROLE_SUCCESS_KEY) or {} if r not in roles]
    out = {}
    for role in roles:
        wins = [ep.error is None and ep.terminated and not ep.truncated
                and bool((ep.info.get(ROLE_SUCCESS_KEY) or {}).get(role)) for ep in episodes]
        rewards = [float((ep.info.get("role_rewards") or {}).get(role, ep.reward)) for ep in episodes]
        out[role] = tally(wins, rewards)
    return out


def eval_tasks(env_name: str, env_config: dict[str, Any], split: str, n: int) -> list[dict[str, Any]]:
    """The first ``n`` tasks of ``split`` (aliases: heldout, eval -> test); fewer when the split is
    smaller."""
    from agentrl.env import make

    real = SPLIT_ALIASES.get(split, split)
    out = []
    for task in make(env_name, **env_config).tasks(real):
        if len(out) >= n:
            break
        out.append(task)
    if not out:
        raise ValueError(f"environment {env_name!r} has no tasks in split {real!r}")
    return out


async def evaluate(env: str, endpoint: str | ChatClient, tasks: int | list[dict[str, Any]] = 100, *,
                   split: str = "test",
                   env_config: dict[str, Any] | None = None, api_key: str = "", model: str = "",
                   limits: EpisodeLimits | None = None, concurrency: int = 32, success_reward: float = 0.0,
                   sandbox_pool: SandboxPool | ImagePools | None = None,
                   sandbox_config: SandboxConfig | None = None,
                   roles: Mapping[str, RoleBinding] | None = None) -> EvalResult:
    """Run one episode per task and measure success.

    ``endpoint``: an OpenAI base URL ending in ``/v1`` or a :class:`~agentrl.rollout.protocols.ChatClient`
    (e.g. a :class:`Router`). ``tasks``: how many of ``split``'s tasks (from the start, so two
    evaluations see the same tasks) or the task dicts themselves. ``limits``: the episode limits and
    sampling (default :class:`EpisodeLimits` at temperature 1). Environments that need a sandbox get
    a pool here (``sandbox_config``'s limits) unless ``sandbox_pool`` is given. ``roles``: a
    multi-agent environment's bindings (``env.roles``), each role played by its own as in training.
    """
    from agentrl.env.registry import sandbox_image_of
    from agentrl.rollout.episode import run_episode
    from agentrl.sandbox.attach import pool_for

    env_config = dict(env_config or {})
    limits = limits or EpisodeLimits()
    task_list = eval_tasks(env, env_config, split, tasks) if isinstance(tasks, int) else list(tasks)
    t0 = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        if isinstance(endpoint, str):
            client = await stack.enter_async_context(OpenAIChat(endpoint, api_key=api_key, model=model,
                                                                timeout_s=limits.episode_timeout_s))
            endpoint_name = endpoint
        else:
            client, endpoint_name = endpoint, "in-process router"
        if sandbox_pool is None:
            sandbox_pool = await pool_for(
                sandbox_image_of(env, env_config),
                sandbox_config or SandboxConfig(warm=0, max_concurrency=concurrency),
                f"eval-{uuid.uuid4().hex[:6]}",
            )
            if sandbox_pool is not None:
                stack.push_async_callback(sandbox_pool.close)
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(task: dict[str, Any]) -> Any:
            async with gate:
                return await run_episode(client, env, task, group_id=f"eval-{task.get('id', '')}",
                                         env_config=env_config, sandbox_pool=sandbox_pool, limits=limits,
                                         roles=roles)

        episodes = await asyncio.gather(*(one(t) for t in task_list))
        model_name = client.model_name
    wins = [is_success(ep, success_reward) for ep in episodes]
    rewards = [float(ep.reward) for ep in episodes]
    n = len(episodes)
    rows = []
    for ep, won, task in zip(episodes, wins, task_list, strict=True):
        row = ep.summary()
        row.pop("info", None)
        row["success"] = won
        if task.get(MIX_TAG):
            row[MIX_TAG] = task[MIX_TAG]
        rows.append(row)
    errors = [ep.error for ep in episodes if ep.error]
    if errors:
        log.warning("%d of %d evaluation episodes failed; first: %s", len(errors), n, errors[0])
    return EvalResult(
        env=env, split=SPLIT_ALIASES.get(split, split), endpoint=endpoint_name, model=model_name,
        **tally(wins, rewards), failed=len(errors),
        truncated=sum(bool(ep.truncated) for ep in episodes),
        turns_mean=sum(ep.turns for ep in episodes) / n if n else 0.0, seconds=time.monotonic() - t0,
        temperature=limits.temperature, declared=sum(SUCCESS_KEY in ep.info for ep in episodes),
        episodes=rows, by_env=tally_by_env(task_list, wins, rewards), by_role=tally_by_role(episodes))


def write_result(result: EvalResult, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(asdict(result), indent=1, default=str) + "\n")
    return p


def main(env: str, endpoint: str, *, out: str | None, api_key_file: str = "", **kwargs: Any) -> int:
    """The CLI command: print a summary line, write the JSON result, print it as the last line."""
    from agentrl.credentials import find_client_key

    api_key = find_client_key(api_key_file)
    try:
        result = asyncio.run(evaluate(env, endpoint, api_key=api_key, **kwargs))
    except (RouterError, ValueError) as e:
        raise SystemExit(f"agentrl eval: {getattr(e, 'message', e)}") from None
    path = write_result(
        result, out or f"runs/eval/{env}-{result.split}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    print(result.line(), flush=True)
    print(f"wrote {path}", flush=True)
    print(json.dumps(result.summary()), flush=True)
    return 0
