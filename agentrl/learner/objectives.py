"""Policy objectives: from logprobs, advantages and weights to a scalar to call backward on.

Role: the policy-gradient losses ``learn.loss.kind`` selects (docs/losses.md): plain policy
gradient (``pg``), PPO's clipped objective (``ppo``), decoupled PPO (``decoupled_ppo``), GSPO's
sequence-level clipped ratio (``gspo``) and CISPO's clipped, stop-gradient importance weight
(``cispo``). Pure functions of torch tensors.

Invariants:
- ``logp`` is the only input that carries gradient; ``logp_old`` / ``logp_prox``, importance
  weights and masks are detached. Stats are detached 0-dim tensors.
- Masked-out positions (padding, prompt, tool output, garbage logprobs) never reach a value or a
  gradient: every ratio is formed from log-differences set to 0 there before the exp.
- A row whose mask is all zero contributes exactly 0, in the value and in the gradient.
- Advantages may be [B] (one per sequence) or [B, T] (one per token).
"""

from __future__ import annotations

from typing import Literal, TypedDict, Unpack

import torch
from torch import Tensor

from agentrl.learner.corrections import Stats, log_ratio
from agentrl.learner.masked import Agg, aggregate, as_bool, masked_max, masked_mean

__all__ = [
    "Reduction",
    "cispo_loss",
    "decoupled_ppo_loss",
    "gspo_loss",
    "policy_gradient_loss",
    "ppo_clip_loss",
]


class Reduction(TypedDict, total=False):
    """How an objective reduces its per-token terms to the loss: :func:`~agentrl.learner.masked.aggregate`'s
    ``agg`` (``token-mean`` unless the objective says otherwise), ``denominator`` and ``norm_tokens``."""

    agg: Agg
    denominator: float | Tensor | None
    norm_tokens: float


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    a = advantages.detach().to(like.dtype)
    return a.unsqueeze(-1) if a.dim() == 1 else a


def _clip_stats(high: Tensor, low: Tensor, m: Tensor, ratio: Tensor, rows: Tensor) -> Stats:
    """The clipped fractions over the counted tokens ``m``, and the ratio's mean and max over ``rows``
    (the tokens, or the sequences for a sequence-level ratio)."""
    dtype = ratio.dtype
    return {
        "clip_frac": masked_mean((high | low).to(dtype), m),
        "clip_frac_high": masked_mean(high.to(dtype), m),
        "clip_frac_low": masked_mean(low.to(dtype), m),
        "ratio_mean": masked_mean(ratio, rows),
        "ratio_max": masked_max(ratio, rows),
    }


def _clipped_surrogate(ratio: Tensor, a: Tensor, m: Tensor, clip_low: float, clip_high: float,
                       is_weights: Tensor | None, reduce: Reduction) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped term, aggregated: per token ``-w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) *
    A)``.
    Also the tokens the clip took from the gradient (detached): A > 0 above the range, A < 0 below it."""
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * a
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, m, **reduce)
    with torch.no_grad():
        r = ratio.detach()
        high = (a > 0) & (r > 1.0 + clip_high)
        low = (a < 0) & (r < 1.0 - clip_low)
    return loss, high, low


def policy_gradient_loss(logp: Tensor, advantages: Tensor, mask: Tensor, is_weights: Tensor | None = None,
                         **reduce: Unpack[Reduction]) -> tuple[Tensor, Stats]:
    """REINFORCE / single-step GRPO: ``loss = agg(-(w * A * logp))``, w detached (1 if None)."""
    a = _per_token(advantages, logp)
    per_token = -a * logp
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, mask, **reduce)
    stats = {"tokens": as_bool(mask).sum().to(logp.dtype).detach()}
    return loss, stats


def ppo_clip_loss(logp: Tensor, logp_prox: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 0.2,
                  clip_high: float = 0.2, is_weights: Tensor | None = None,
                  **reduce: Unpack[Reduction]) -> tuple[Tensor, Stats]:
    """PPO clipped objective against a proximal policy, optionally importance-weighted.

    ``r = exp(logp - logp_prox)``; per token ``-w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``.
    ``clip_high > clip_low`` is DAPO's clip-higher. Stats: ``clip_frac`` (tokens whose clipped
    term is strictly the smaller, i.e. that get no gradient), split into ``clip_frac_high``
    (A > 0, r > 1 + clip_high) and ``clip_frac_low`` (A < 0, r < 1 - clip_low); ``ratio_mean``,
    ``ratio_max``.
    """
    m = as_bool(mask)
    a = _per_token(advantages, logp)
    log_r = logp - logp_prox.detach()
    log_r = torch.where(m, log_r, torch.zeros_like(log_r))
    ratio = torch.exp(log_r)
    loss, high, low = _clipped_surrogate(ratio, a, m, clip_low, clip_high, is_weights, reduce)
    return loss, _clip_stats(high, low, m, ratio.detach(), m)


def decoupled_ppo_loss(
    logp: Tensor,
    logp_prox: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_cap: float | None = None,
    is_cap_mode: Literal["truncate", "mask"] = "truncate",
    **reduce: Unpack[Reduction],
) -> tuple[Tensor, Stats]:
    """Decoupled PPO (AReaL): ``-(pi_prox / mu) * min(r * A, clip(r) * A)``, ``r = pi_theta / pi_prox``.

    The trust region is taken around the proximal policy, and the detached factor ``pi_prox / mu``
    corrects for the tokens having been sampled by the behaviour policy mu. With ``is_cap`` the
    factor is truncated at the cap (``truncate``) or, as in AReaL's ``behav_imp_weight_cap``,
    tokens above the cap get weight 0 (``mask``; they still count in the denominator). Stats:
    those of ``ppo_clip_loss`` plus ``is_mean``, ``is_max`` (raw), ``is_frac_capped``.
    """
    m = as_bool(mask)
    with torch.no_grad():
        raw = torch.exp(log_ratio(logp_prox, logp_behaviour, m))
        if is_cap is None:
            w, capped = raw, torch.zeros_like(m)
        elif is_cap_mode == "truncate":
            w, capped = torch.clamp(raw, max=is_cap), raw > is_cap
        elif is_cap_mode == "mask":
            capped = raw > is_cap
            w = torch.where(capped, torch.zeros_like(raw), raw)
        else:
            raise ValueError(f"unknown is_cap_mode {is_cap_mode!r}; use truncate or mask")
        w = torch.where(m, w, torch.zeros_like(w))
    loss, stats = ppo_clip_loss(logp, logp_prox, advantages, m, clip_low, clip_high, w, **reduce)
    stats["is_mean"] = masked_mean(w, m)
    stats["is_max"] = masked_max(raw, m)
    stats["is_frac_capped"] = masked_mean(capped.to(w.dtype), m)
    return loss, stats


def gspo_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 3e-4,
              clip_high: float = 4e-4, is_weights: Tensor | None = None,
              **reduce: Unpack[Reduction]) -> tuple[Tensor, Stats]:
    """GSPO (Zheng et al. 2025, *Group Sequence Policy Optimization*): PPO's clip on a sequence ratio.

    ``s_i = exp(mean_t (log pi_theta - log pi_old))`` over sequence i's counted tokens (the
    length-normalised sequence likelihood ratio); per token ``-w * min(s_it * A, clip(s_it, 1 -
    clip_low, 1 + clip_high) * A)`` with ``s_it = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t))``,
    which equals ``s_i`` in value. That is the paper's GSPO-token form: for one advantage per
    sequence its gradient is GSPO's, ``s_i * A_i * mean_t grad log pi_theta(y_t)``, and it also
    takes per-token advantages. Its default ``agg``, ``seq-mean-token-mean``, makes each sequence count
    once (GSPO's ``1/G sum_i``). A sequence whose clipped term is the smaller gets no gradient at
    all: the clip acts on whole sequences, and its range is in the 1e-4s because ``s_i`` is a
    geometric mean. Stats as ``ppo_clip_loss`` (``clip_frac`` over tokens, ratios per sequence).
    """
    m = as_bool(mask)
    a = _per_token(advantages, logp)
    diff = torch.where(m, logp - logp_old.detach(), torch.zeros_like(logp))
    log_s = masked_mean(diff, m, dim=-1).detach()  # [B]; 0 for a sequence with no counted token
    # value s_i at every token, gradient s_i * grad log pi(y_t) through the token's own logprob
    token_grad = torch.where(m, logp - logp.detach(), torch.zeros_like(logp))
    s = torch.exp(log_s.unsqueeze(-1) + token_grad)
    loss, high, low = _clipped_surrogate(s, a, m, clip_low, clip_high, is_weights,
                                         {"agg": "seq-mean-token-mean", **reduce})
    return loss, _clip_stats(high, low, m, torch.exp(log_s), m.any(-1))


def cispo_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 1.0,
               clip_high: float = 1.0, is_weights: Tensor | None = None,
               **reduce: Unpack[Reduction]) -> tuple[Tensor, Stats]:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped, stop-gradient ratio.

    ``r = pi_theta / pi_old``; per token ``-w * sg(clip(r, 1 - clip_low, 1 + clip_high)) * A *
    log pi_theta``. Unlike PPO, no token loses its gradient: the clip bounds how much a token's
    update is scaled, not whether it happens, so rare tokens whose ratio jumps after the first
    update still train. MiniMax-M1 leaves the floor open (``clip_low = 1``: weights >= 0) and
    tunes only the ceiling. Stats: ``clip_frac`` (tokens whose ratio was clipped), split into
    ``clip_frac_high`` / ``clip_frac_low``, ``ratio_mean``, ``ratio_max``.
    """
    m = as_bool(mask)
    a = _per_token(advantages, logp)
    with torch.no_grad():
        r = torch.exp(log_ratio(logp, logp_old, m))
        weight = torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high)
        if is_weights is not None:
            weight = weight * is_weights.detach()
    per_token = -weight * a * logp
    loss = aggregate(per_token, m, **reduce)
    with torch.no_grad():
        stats = _clip_stats(r > 1.0 + clip_high, r < 1.0 - clip_low, m, r, m)
    return loss, stats
