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
class RolloutConfig(EpisodeLimits):
    """serve's ``env`` section: which environment, how episodes are grouped and how many run at once."""

    name: str = "arithmetic"  # a registered environment (`agentrl envs list`)
    imports: list[str] = field(default_factory=list, metadata={"key": "import"})
    """Modules (my_envs, pkg.tasks) or Python files (./my_env.py) imported before ``name`` is looked
    up, so an environment defined there is known: ``--env.import=my_env.py``."""
    config: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the environment
    group_size: int = 4  # episodes per task (GRPO group)
    max_concurrency: int = 64  # episodes in flight at most
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
