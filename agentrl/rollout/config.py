"""Configuration of rollouts: an episode's limits, the orchestrator's settings (serve's ``env``
section), who plays the episodes (``scaffold``, a tagged union) and held-out evaluation (``eval``).

:class:`RolloutConfig` *is* an :class:`EpisodeLimits` (it adds what the orchestrator needs), so
the same object bounds every episode and no limit is copied by hand. Only the standard library is
imported here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class EpisodeLimits:
    """What one episode may spend, and how the built-in loop samples."""

    max_turns: int = 4  # assistant messages per episode
    max_tokens: int = 128  # completion tokens per model call
    max_episode_tokens: int = 1024  # completion tokens per episode before it is truncated
    episode_timeout_s: float = 300.0  # wall-clock limit per episode
    temperature: float = 1.0  # sampling temperature of the built-in loop's calls
    top_p: float = 1.0  # nucleus sampling of the built-in loop's calls
    top_k: int = 0  # top-k sampling of the built-in loop's calls (0: off); needed with top_p < 1 or min_p > 0
    min_p: float = 0.0  # min-p sampling of the built-in loop's calls (0: off)


@dataclass
class RoleBinding:
    """``env.roles.<role>``: what plays one role of a multi-agent environment
    (:class:`agentrl.env.roles.MultiAgentEnv`). At most one of ``policy`` (with or without ``lag`` or
    ``version``), ``frozen`` and ``endpoint``;
    none binds the role to the default policy, which it then trains together with every other role
    bound to it. A frozen or endpoint role's calls are recorded in the episode graph (and a frozen
    role's in its router session) but produce no training samples."""

    policy: str = ""  # a named LoRA policy (serve.policies): trained on this role's samples alone
    lag: int = 0
    """with it, never trained: the policy (``policy``, or the default one) as it was ``lag`` versions
    back, advancing as it does (self-play against an earlier self; needs LoRA: the engines keep
    ``lag + 1`` of its versions loaded)"""
    version: int = 0
    """with it, never trained: the policy's (``policy``, or the default one) published version
    ``version``, whatever versions come after (a fixed opponent; needs LoRA: the engines keep it loaded
    beside the policy's window, serve keeps its folder on disk). Until it is published the role's calls
    sample the base weights, their tokens carrying version 0."""
    frozen: bool = False
    """the engines' base model, never trained (an engine with LoRA adapters serves it beside them, so it
    needs LoRA policies: engine.lora_rank > 0)"""
    advantage: Literal["group", "baseline", "team"] = "group"
    """how its samples' advantages are formed: ``group`` (GRPO against the same role in the group's other
    episodes), ``baseline`` (its reward minus a running mean of its reward, for self-play, where a
    group's episodes are not comparable) or ``team`` (the episode's shared team reward, compared across
    the group)"""
    loss_weight: float = 1.0  # scales its samples' advantages, so their weight in the loss
    endpoint: str = ""  # an OpenAI-compatible base URL (a judge, a simulated user): never trained
    endpoint_model: str = ""  # the endpoint's model (empty: the first it lists)
    api_key_env: str = ""  # the environment variable holding the endpoint's API key (empty: none)

    @property
    def trained(self) -> bool:
        return not (self.frozen or self.endpoint or self.lag or self.version)

    def describe(self) -> str:
        if self.endpoint:
            return f"endpoint {self.endpoint}"
        if self.frozen:
            return "frozen (the base model)"
        who = f"policy {self.policy}" if self.policy else "the default policy"
        if self.version:
            return f"{who} at version {self.version}"
        return f"{who}, {self.lag} version(s) back" if self.lag else who


POOLS = ("new", "learnable", "hard", "easy")  # the curriculum's (agentrl/rollout/curriculum.py)


@dataclass
class CurriculumConfig:
    """serve's ``env.curriculum`` (docs/curriculum.md)."""

    enabled: bool = False  # off: the task stream in order, each task in one group
    hard: float = 0.2  # a pass rate at or below: the hard pool
    easy: float = 0.8  # at or above: the easy pool
    weights: dict[str, float] = field(default_factory=lambda: {"new": 1.0, "learnable": 2.0, "hard": 0.25,
                                                               "easy": 0.1})
    """How often each pool is drawn from, among the non-empty ones (``new``: the stream's next task)."""
    max_plays: int = 4  # groups one task is played in at most
    seed: int = 0  # the draws' randomness (each draw's from the seed and its number: a restart repeats it)

    def check(self) -> None:
        if not 0.0 <= self.hard < self.easy <= 1.0:
            raise ValueError(f"env.curriculum: need 0 <= hard < easy <= 1 (got hard {self.hard}, "
                             f"easy {self.easy})")
        unknown = sorted(set(self.weights) - set(POOLS))
        if unknown:
            raise ValueError(f"env.curriculum.weights: unknown pool(s) {unknown}; the pools are "
                             f"{list(POOLS)}")
        if any(w < 0 for w in self.weights.values()) or self.weights.get("new", 0.0) <= 0:
            raise ValueError("env.curriculum.weights: weights must be >= 0, and new > 0 (or the "
                             "rollout would never see an unseen task)")
        if self.max_plays < 1:
            raise ValueError(f"env.curriculum.max_plays must be >= 1 (got {self.max_plays})")


@dataclass
class ConcurrencyConfig:
    """serve's ``env.concurrency``: the concurrency controller (docs/concurrency.md). Off, the static
    ``env.max_concurrency`` is the cap; on, it is the controller's upper bound."""

    controller: bool = False  # on: the limit follows the engines' KV usage, queues and preemptions
    interval_s: float = 1.0  # seconds between reads of the engines' /metrics
    min: int = 0  # the lowest limit, in episodes (0 or below a group: one group)
    initial: int = 0  # the limit at the start (0: two groups)
    step: int = 0  # episodes added per growth after slow start (0: one group)
    slow_start: bool = True  # double the limit per growth until the first back-off
    decrease: float = 0.7  # a back-off multiplies the limit by this
    kv_soft: float = 0.85  # KV-cache usage (0..1) at or above which it backs off
    kv_hard: float = 0.97  # KV-cache usage at or above which no new group starts until it drops
    queue_tolerance: float = 0.25
    """waiting requests up to this fraction of the running ones (and one, at least) are scheduling lag,
    not a queue: they neither stop growth nor, growing, back off"""
    hold_ticks: int = 2  # reads after a back-off before the next one (a cut takes time to drain)

    def check(self) -> None:
        if not 0.0 < self.kv_soft <= self.kv_hard <= 1.0:
            raise ValueError(f"env.concurrency: need 0 < kv_soft <= kv_hard <= 1 (got kv_soft "
                             f"{self.kv_soft}, kv_hard {self.kv_hard})")
        if not 0.0 < self.decrease < 1.0:
            raise ValueError(f"env.concurrency.decrease must be in (0, 1) (got {self.decrease})")
        if self.interval_s <= 0:
            raise ValueError(f"env.concurrency.interval_s must be > 0 (got {self.interval_s})")


@dataclass
class RolloutConfig(EpisodeLimits):
    """serve's ``env`` section: which environment, how episodes are grouped and how many run at once."""

    name: str = "arithmetic"  # a registered environment (`agentrl envs list`)
    imports: list[str] = field(default_factory=list, metadata={"key": "import"})
    """Modules (my_envs, pkg.tasks) or Python files (./my_env.py) imported before ``name`` is looked
    up, so an environment defined there is known: ``--env.import=my_env.py``."""
    config: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the environment
    group_size: int = 4  # episodes per task (GRPO group)
    max_concurrency: int = 64  # episodes in flight at most (with env.concurrency.controller, its upper bound)
    concurrency: ConcurrencyConfig = field(default_factory=ConcurrencyConfig)
    """Off (the default): ``max_concurrency`` episodes in flight at most. On (``controller``): a limit
    that follows the engines' /metrics, within ``max_concurrency`` (docs/concurrency.md)."""
    roles: dict[str, RoleBinding] = field(default_factory=dict)
    """A multi-agent environment's roles, each bound to what plays it (a role left out plays on the
    default policy): ``--env.roles.solver.policy=solver``, ``--env.roles.judge.frozen=true``."""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Which task each group plays: off, the stream in order, each once; on, the stream's next task
    or a replay of one whose pass rate says it still teaches (docs/curriculum.md)."""
    mode: Literal["async", "sync"] = "async"
    """async: keep episodes running while the learner trains. sync: the synchronous baseline (generate
    a whole batch, wait for the slowest episode, train, sync weights, repeat), for measuring what
    the asynchronous pipeline gains."""

    def limits(self, **changes: Any) -> EpisodeLimits:
        """The episode limits alone, with ``changes`` (e.g. an evaluation's temperature)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(EpisodeLimits)}
        return EpisodeLimits(**{**values, **changes})


@dataclass
class LoopScaffold:
    """The built-in agent loop plays the episodes: the environment's tools, through the router in-process."""

    kind: Literal["builtin"] = "builtin"


@dataclass
class FunctionScaffold:
    """An async Python callable plays each episode, in serve, against a per-episode OpenAI base URL."""

    kind: Literal["agent"] = "agent"
    agent: str = ""  # "package.module:function", e.g. "scaffolds.openai_minimal:agent"


@dataclass
class ProgramScaffold:
    """A program plays each episode, run on the host with OPENAI_BASE_URL / OPENAI_API_KEY set; its stdout is
    the answer."""

    kind: Literal["command"] = "command"
    command: str = ""  # the command line ({python}: serve's own Python), split as a shell would
    env: list[str] = field(default_factory=list)
    """serve's environment variables the program may also see (it gets only PATH, HOME, the locale and
    a few such, plus its episode's OPENAI_* and AGENTRL_* variables; never serve's secrets)."""


# the config of who plays; the player itself is :data:`agentrl.rollout.scaffold.Scaffold`
ScaffoldConfig = LoopScaffold | FunctionScaffold | ProgramScaffold


@dataclass
class EvalConfig:
    """Held-out evaluation: ``agentrl eval``, and what ``agentrl run`` does before training and after it."""

    tasks: int = 100  # held-out ("test" split) tasks, one episode each (0: no evaluation in agentrl run)
    temperature: float = 1.0
    """sampling temperature of the evaluated agent (1.0: as it acts in training; 0: greedy)"""
    concurrency: int = 32  # evaluation episodes in flight
    success_reward: float = 0.0  # an episode succeeds above this reward, where its env declares no success
