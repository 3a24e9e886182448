"""Scorers registered by name, like environments: ``@agentrl.scorer("name")`` on an async callable
``(task, episode) -> float`` (the episode is an :class:`agentrl.rollout.episode.EpisodeResult`:
its ``answer``, ``reward``, ``info`` and token-level ``samples``). A process scorer,
``@agentrl.scorer("name", per_turn=True)``, returns one reward per generated turn instead (a list,
in the turns' order). Imports nothing heavy."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Scorer = Callable[[dict[str, Any], Any], Awaitable[float]]

_SCORERS: dict[str, Scorer] = {}


def scorer(name: str, *, per_turn: bool = False) -> Callable[[Scorer], Scorer]:
    """Register ``fn`` as the scorer ``name`` (``serve.scoring.scorers`` names it with a weight).
    ``per_turn``: a process scorer, whose value is a list of rewards, one per generated turn."""
    if not name or not isinstance(name, str):
        raise ValueError("a scorer needs a non-empty name")

    def register(fn: Scorer) -> Scorer:
        if not callable(fn):
            raise TypeError(f"scorer {name!r} must be an async callable (task, episode) -> "
                            f"{'list of per-turn rewards' if per_turn else 'float'}")
        if per_turn:
            fn.__agentrl_per_turn__ = True  # type: ignore[attr-defined]
        _SCORERS[name] = fn
        return fn

    return register


def get_scorer(name: str) -> Scorer:
    try:
        return _SCORERS[name]
    except KeyError:
        known = ", ".join(sorted(_SCORERS)) or "none registered"
        raise KeyError(f"no scorer named {name!r} (registered: {known}; register one with "
                       f"@agentrl.scorer({name!r}) in a file serve.env.import names)") from None


def is_per_turn(fn: Any) -> bool:
    """Whether ``fn`` is a process scorer (one reward per generated turn)."""
    return bool(getattr(fn, "__agentrl_per_turn__", False))
