"""Scorers registered by name, like environments: ``@agentrl.scorer("name")`` on an async callable
``(task, episode) -> float`` (the episode is an :class:`agentrl.rollout.episode.EpisodeResult`:
its ``answer``, ``reward``, ``info`` and token-level ``samples``). A process scorer,
``@agentrl.scorer("name", per_turn=True)``, returns one reward per generated turn instead (a list,
in the turns' order); with ``split=`` one reward per segment, the generated turns cut where the
splitter says (:func:`split_at_token`, :func:`split_text`). Imports nothing heavy."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Scorer = Callable[[dict[str, Any], Any], Awaitable[float]]
Splitter = Callable[[list[int]], list[int]]
"""A generated turn's token ids -> the end offsets of its segments in it (each just past a segment's
last token, increasing, within the turn); the turn's end always ends a segment."""

_SCORERS: dict[str, Scorer] = {}


def whole_turn(turn: list[int]) -> list[int]:
    """The splitter of a per-turn scorer: each generated turn is one segment."""
    return [len(turn)]


def split_at_token(token_id: int) -> Splitter:
    """A splitter that ends a segment after each ``token_id`` (a step tag, a newline token)."""
    def split(turn: list[int]) -> list[int]:
        return [k + 1 for k, t in enumerate(turn) if t == token_id]

    return split


def split_text(tokenizer: PreTrainedTokenizerBase, delimiter: str = "\n\n") -> Splitter:
    """A splitter that ends a segment after the token that completes each ``delimiter`` in the
    turn's text (``tokenizer``: the served model's, from transformers). The text is the turn's tokens
    decoded one at a time, so a delimiter of plain ASCII is found wherever the whole decoded text
    holds it."""
    if not delimiter:
        raise ValueError("split_text needs a non-empty delimiter")

    def split(turn: list[int]) -> list[int]:
        ends, text, seen = [], "", 0
        for k, t in enumerate(turn, 1):
            text += tokenizer.decode([t])
            completed = False
            while (found := text.find(delimiter, seen)) >= 0:  # all this token completed: one end
                seen, completed = found + len(delimiter), True
            if completed:
                ends.append(k)
        return ends

    return split


def scorer(name: str, *, per_turn: bool = False, split: Splitter | None = None) -> Callable[[Scorer], Scorer]:
    """Register ``fn`` as the scorer ``name`` (``serve.scoring.scorers`` names it with a weight).
    ``per_turn``: a process scorer, whose value is a list of rewards, one per generated turn.
    ``split``: a process scorer over segments, one reward per segment of the generated turns as
    ``split`` cuts them (:func:`agentrl.scoring.generated_segments` gives the scorer their tokens)."""
    if not name or not isinstance(name, str):
        raise ValueError("a scorer needs a non-empty name")
    if split is not None and not callable(split):
        raise TypeError(f"scorer {name!r}: split must be a callable (turn token ids) -> segment end offsets")

    def register(fn: Scorer) -> Scorer:
        process = per_turn or split is not None
        if not callable(fn):
            raise TypeError(f"scorer {name!r} must be an async callable (task, episode) -> "
                            f"{'list of per-segment rewards' if process else 'float'}")
        if process:
            fn.__agentrl_split__ = split or whole_turn  # type: ignore[attr-defined]
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


def splitter_of(fn: Scorer) -> Splitter | None:
    """A process scorer's splitter (:func:`whole_turn` for a per-turn one); None for an outcome scorer."""
    return getattr(fn, "__agentrl_split__", None)
