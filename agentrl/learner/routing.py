"""Routing replay for mixture-of-experts models: the learner's forward pass through the experts the
engine used when it sampled ("Keep Routing", R3).

An MoE layer's gate picks each token's top-k experts from its logits; floating-point differences
between engine and learner (another precision, other kernels) flip near-ties, and the learner then
computes logprobs through experts the sampler never used. :func:`replay_routing` patches every
top-k router of a transformers MoE model (Qwen3-MoE style: its forward returns the router
logits, the top-k scores and the top-k indices) for the span of a forward pass: a token with a
recorded routing goes to the recorded experts, weighted by the gate's own probabilities for them
(softmax over all experts, gathered, renormalised when the model normalises its top-k), so the gate
still gets its gradient; a token without one (an id < 0: a prompt token the engine took from its
prefix cache, or padding) is routed by the learner as usual.

``experts`` is [batch, tokens, moe layers, k] aligned with the forward's ``input_ids`` (any packing
of sequences into rows: each token is routed on its own). :class:`ReplayStats` counts the tokens
whose learner routing differs from the recorded one (as sets), per call.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "weight")]


@dataclass
class ReplayStats:
    """What a replayed forward pass took from the record: ``replayed`` (token, layer) routings, of
    which the learner's own routing would have ``differed`` (as sets); over tokens, ``tokens`` with a
    record in some layer and ``tokens_differed`` whose own routing differed in at least one.
    ``mark_flips`` keeps, per router call, which tokens of the pass differed (``flipped``)."""

    replayed: int = 0
    differed: int = 0
    mark_flips: bool = False
    flipped: list[torch.Tensor] = field(default_factory=list)
    _has: torch.Tensor | None = None  # per token of the latest pass: recorded in some layer
    _flip: torch.Tensor | None = None  # ... and differed in some layer

    @property
    def disagreement(self) -> float:
        return self.differed / self.replayed if self.replayed else 0.0

    def _note(self, has: torch.Tensor, differs: torch.Tensor) -> None:
        if self._has is None or self._has.shape != has.shape:
            self._has, self._flip = has.clone(), differs.clone()
        else:
            self._has |= has
            self._flip |= differs

    @property
    def tokens(self) -> int:
        """Tokens of the latest pass with a record (read after the forward)."""
        return int(self._has.sum()) if self._has is not None else 0

    @property
    def tokens_differed(self) -> int:
        return int(self._flip.sum()) if self._flip is not None else 0


def _forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    _, own = torch.topk(probs, self.top_k, dim=-1)
    recorded = self._agentrl_recorded
    indices = own
    if recorded is not None:  # counted whether or not it is followed
        rec = recorded.reshape(-1, recorded.shape[-1]).to(own.device, torch.long)
        if rec.shape[0] != own.shape[0]:
            raise ValueError(f"routing replay: {rec.shape[0]} recorded tokens for a pass over {own.shape[0]}")
        has = (rec >= 0).all(dim=-1)
        if self._agentrl_follow:
            indices = torch.where(has[:, None], rec, own)
        n = int(has.sum())
        if n:
            stats = self._agentrl_stats
            same = (torch.sort(rec, dim=-1).values == torch.sort(own, dim=-1).values).all(dim=-1)
            differs = has & ~same
            stats.replayed += n
            stats.differed += int(differs.sum())
            stats._note(has, differs)
            if stats.mark_flips:
                stats.flipped.append(differs)
    scores = probs.gather(-1, indices)
    if getattr(self, "norm_topk_prob", False):
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return logits, scores.to(logits.dtype), indices


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, experts: torch.Tensor | None,
                   stats: ReplayStats | None = None, follow: bool = True) -> Iterator[ReplayStats]:
    """Within the block, the model's routers use ``experts`` ([batch, tokens, layers, k]; ids < 0:
    the learner's own routing); ``None`` replays nothing and counts nothing; ``follow=False`` routes
    as the learner would and only counts where that differs from ``experts``. Yields the stats."""
    routers = moe_routers(model)
    stats = stats if stats is not None else ReplayStats()
    if experts is not None and experts.shape[-2] != len(routers):
        raise ValueError(f"routing replay: {experts.shape[-2]} recorded "
                         f"layers for a model with {len(routers)}")
    for i, r in enumerate(routers):
        r._agentrl_recorded = None if experts is None else experts[..., i, :]
        r._agentrl_stats = stats
        r._agentrl_follow = follow
        r.forward = types.MethodType(_forward, r)
    try:
        yield stats
    finally:
        for r in routers:
            del r.forward
            r._agentrl_recorded = None
