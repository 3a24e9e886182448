"""Rollouts: the built-in agent loop and the orchestrator that keeps episodes running."""

from agentrl._lazy import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "agentrl.rollout.episode": ["EpisodeLimits", "EpisodeResult", "run_episode"],
    "agentrl.rollout.orchestrator": ["Orchestrator"],
})
