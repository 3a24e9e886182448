"""Rollouts: the built-in agent loop and the orchestrator that keeps episodes running."""

from typing import TYPE_CHECKING

from agentrl._lazy import lazy

if TYPE_CHECKING:
    from agentrl.rollout.episode import EpisodeLimits, EpisodeResult, run_episode
    from agentrl.rollout.orchestrator import Orchestrator

__getattr__, __dir__ = lazy(__name__, {
    "EpisodeLimits": "agentrl.rollout.episode",
    "EpisodeResult": "agentrl.rollout.episode",
    "run_episode": "agentrl.rollout.episode",
    "Orchestrator": "agentrl.rollout.orchestrator",
})

__all__ = ["EpisodeLimits", "EpisodeResult", "Orchestrator", "run_episode"]
