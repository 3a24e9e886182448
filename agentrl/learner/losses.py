"""The learner's loss: one entry point from the ``learn.loss`` settings to a scalar and its stats.

Role: :func:`compute_loss` applies the off-policy correction (:mod:`agentrl.learner.corrections`)
and the chosen objective (:mod:`agentrl.learner.objectives`) in a fixed order, and reports what
it did. The math lives in those modules and in :mod:`agentrl.learner.masked` (reductions,
aggregation) and :mod:`agentrl.learner.advantages`; this module re-exports it, so
``from agentrl.learner.losses import ...`` reaches every pure function. Formulas, settings and
when to use each: docs/losses.md.

Conventions and invariants (all the parts share them):
- Token tensors are [B, T]. ``mask`` [B, T] (bool or 0/1 float) is true exactly on the
  model-generated tokens that count in the loss; anything at a masked-out position (padding,
  prompt, tool output, even inf/NaN logprobs) never reaches a loss, a weight or a gradient.
- ``logp`` is the only input that carries gradient. Importance weights, proximal logprobs and
  masks are computed under no_grad / detached, and every stats dict holds detached 0-dim tensors
  (no ``.item()`` here, so no device sync; the caller logs them).
- A row whose mask is all zero (a zero-length completion) contributes exactly 0 to every loss and
  never produces NaN, neither in the value nor in the gradient.
- Advantages may be [B] (one per sequence) or [B, T] (one per token).
- ``loss/tokens`` and ``loss/sequences`` count what the loss was taken over after every mask
  (mismatch band, MIS): the caller's denominator, so masked tokens leave it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from agentrl.learner.advantages import episode_advantages, group_advantages
from agentrl.learner.corrections import (
    Level,
    Stats,
    approx_proximal_logp,
    masked_is,
    mismatch_kl,
    mismatch_spread,
    mismatch_token_mask,
    truncated_is,
)
from agentrl.learner.masked import (
    AGGS,
    Agg,
    aggregate,
    as_bool,
    loss_units,
    masked_max,
    masked_mean,
    masked_sum,
)
from agentrl.learner.objectives import (
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    policy_gradient_loss,
    ppo_clip_loss,
)

__all__ = [
    "AGGS",
    "KINDS",
    "Agg",
    "Correction",
    "Level",
    "LossKind",
    "aggregate",
    "approx_proximal_logp",
    "cispo_loss",
    "compute_loss",
    "decoupled_ppo_loss",
    "episode_advantages",
    "group_advantages",
    "gspo_loss",
    "loss_units",
    "masked_is",
    "masked_max",
    "masked_mean",
    "masked_sum",
    "mismatch_kl",
    "mismatch_spread",
    "mismatch_token_mask",
    "policy_gradient_loss",
    "ppo_clip_loss",
    "truncated_is",
]

LossKind = Literal["pg", "ppo", "decoupled_ppo", "gspo", "cispo"]
KINDS: tuple[str, ...] = ("pg", "ppo", "decoupled_ppo", "gspo", "cispo")
Correction = Literal["none", "tis", "mis"]


def compute_loss(
    kind: LossKind,
    correction: Correction,
    *,
    logp: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    mask: Tensor,
    logp_old: Tensor | None = None,
    level: Level = "token",
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    mismatch_band: tuple[float, float] | None = None,
    agg: Agg = "token-mean",
    norm_tokens: float = 0.0,
    denominator: float | Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """One entry point for the config's ``loss.kind`` x ``loss.correction``.

    ``logp_old`` is the learner's detached logprob under the weights at the start of this step
    (pi_old, which decoupled PPO calls pi_prox; ``approx_proximal_logp`` can stand in for it);
    ``None`` means ``logp.detach()``, right for a single gradient step per batch. All corrections
    compare it with the behaviour logprob mu:

    - ``none``: no weight (``decoupled_ppo`` still applies its uncapped pi_old / mu);
    - ``tis``: weight ``min(pi_old / mu, tis_cap)`` at ``level``;
    - ``mis``: drop units whose ratio leaves [mis_low, mis_high]; ``pg``/``ppo``/``gspo``/``cispo``
      give kept tokens weight 1, ``decoupled_ppo`` keeps its weight pi_old / mu on them.

    ``mismatch_band`` additionally drops single tokens whose pi_old / mu leaves the band. Dropped
    tokens leave the loss and its denominator. Stats are prefixed ``loss/``, ``is/``,
    ``mismatch/`` and include the mismatch KL and the counts ``loss/tokens`` and
    ``loss/sequences`` of what the loss was taken over.
    """
    if logp_old is None:
        logp_old = logp.detach()
    logp_old = logp_old.detach()
    mask = as_bool(mask)
    stats: Stats = {}

    # measured before any masking, so the metric shows the mismatch that the masks act on
    stats.update({f"mismatch/kl_{k}": v for k, v in mismatch_kl(logp_old, logp_behaviour, mask).items()})
    stats.update({f"mismatch/{k}": v for k, v in mismatch_spread(logp_old, logp_behaviour, mask).items()})
    if mismatch_band is not None:
        mask, s = mismatch_token_mask(logp_old, logp_behaviour, mask, *mismatch_band)
        stats.update({f"mismatch/{k}": v for k, v in s.items()})

    weights: Tensor | None = None
    if correction == "tis":
        weights, s = truncated_is(logp_old, logp_behaviour, mask, tis_cap, level)
        stats.update({f"is/{k}": v for k, v in s.items()})
    elif correction == "mis":
        mask, s = masked_is(logp_old, logp_behaviour, mask, mis_low, mis_high, level)
        stats.update({f"is/{k}": v for k, v in s.items()})
    elif correction != "none":
        raise ValueError(f"unknown correction {correction!r}; use none, tis or mis")

    reduce = {"agg": agg, "denominator": denominator, "norm_tokens": norm_tokens}
    if kind == "pg":
        loss, s = policy_gradient_loss(logp, advantages, mask, weights, **reduce)
    elif kind == "ppo" or (kind == "decoupled_ppo" and weights is not None):
        # decoupled PPO with TIS is PPO around pi_old weighted by the truncated pi_old / mu
        loss, s = ppo_clip_loss(logp, logp_old, advantages, mask, clip_low, clip_high, weights, **reduce)
    elif kind == "decoupled_ppo":
        # none / mis: the uncapped pi_old / mu on the tokens still in the mask
        loss, s = decoupled_ppo_loss(logp, logp_old, logp_behaviour, advantages, mask, clip_low, clip_high,
                                     **reduce)
    elif kind == "gspo":
        loss, s = gspo_loss(logp, logp_old, advantages, mask, clip_low, clip_high, weights, **reduce)
    elif kind == "cispo":
        loss, s = cispo_loss(logp, logp_old, advantages, mask, clip_low, clip_high, weights, **reduce)
    else:
        raise ValueError(f"unknown loss kind {kind!r}; use one of gspo, cispo, pg, ppo or decoupled_ppo")
    stats.update({f"loss/{k}": v for k, v in s.items()})
    m = as_bool(mask)
    stats["loss/tokens"] = m.sum().to(torch.float64).detach()
    stats["loss/sequences"] = m.any(-1).sum().to(torch.float64).detach()
    stats["loss/loss"] = loss.detach()
    return loss, stats
