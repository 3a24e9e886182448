"""Rollouts: the built-in agent loop and the orchestrator that keeps episodes running."""

from agentrl.rollout.episode import EpisodeLimits, EpisodeResult, run_episode
from agentrl.rollout.orchestrator import Orchestrator

__all__ = ["EpisodeLimits", "EpisodeResult", "Orchestrator", "run_episode"]
