"""Policy losses and off-policy corrections for the learner: pure functions of torch tensors.

Role: everything between "logprobs and advantages" and "a scalar to call backward on", with the
importance weights that correct for samples drawn by an older policy on a different engine. The
formulas, their config names and when to use each are in docs/losses.md.

Conventions and invariants:
- Token tensors are [B, T]. ``mask`` [B, T] (bool or 0/1 float) is true exactly on the
  model-generated tokens that count in the loss; anything at a masked-out position (padding,
  prompt, tool output, even inf/NaN logprobs) never reaches a loss, a weight or a gradient.
- ``logp`` is the only input that carries gradient. Importance weights, proximal logprobs and
  masks are computed under no_grad / detached, and every stats dict holds detached 0-dim tensors
  (no ``.item()`` here, so no device sync; the caller logs them).
- A row whose mask is all zero (a zero-length completion) contributes exactly 0 to every loss and
  never produces NaN, neither in the value nor in the gradient.
- Advantages may be [B] (one per sequence) or [B, T] (one per token).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from agentrl.learner.advantages import group_advantages

__all__ = [
    "Agg",
    "Correction",
    "Level",
    "LossKind",
    "aggregate",
    "approx_proximal_logp",
    "compute_loss",
    "decoupled_ppo_loss",
    "group_advantages",
    "masked_is",
    "masked_max",
    "masked_mean",
    "masked_sum",
    "mismatch_kl",
    "mismatch_token_mask",
    "policy_gradient_loss",
    "ppo_clip_loss",
    "truncated_is",
]

Agg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
Level = Literal["token", "sequence", "geometric"]
LossKind = Literal["pg", "ppo", "decoupled_ppo"]
Correction = Literal["none", "tis", "mis"]
Stats = dict[str, Tensor]


# ---------------------------------------------------------------------------------------------
# masked reductions


def _bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask > 0


def _safe(denominator: Tensor) -> Tensor:
    # Dividing 0 by a safe 1 keeps both the value and the gradient finite where nothing counts;
    # torch.where(d > 0, x / d, 0) would still backpropagate NaN through the untaken branch.
    return torch.where(denominator > 0, denominator, torch.ones_like(denominator))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask``; masked-out entries are dropped even if inf or NaN."""
    kept = torch.where(_bool(mask), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask``; 0 (not NaN) where nothing is selected."""
    count = _bool(mask).to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(values, mask, dim) / _safe(count)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max of ``values`` where ``mask``; 0 where nothing is selected."""
    m = _bool(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return zero
    # no boolean indexing and no .item(): stays on the device without a host sync
    top = torch.where(m, values, torch.full_like(values, -math.inf)).max()
    return torch.where(m.any(), top, zero)


def aggregate(
    values: Tensor,
    mask: Tensor,
    agg: Agg = "token-mean",
    denominator: float | Tensor | None = None,
) -> Tensor:
    """Reduce per-token ``values`` [B, T] to a scalar.

    - ``token-mean``: sum over all counted tokens / number of counted tokens. Every token weighs
      the same, so long completions weigh more (DAPO's token-level loss).
    - ``seq-mean-token-sum``: per-sequence sum, then mean over sequences (Dr. GRPO style; the
      per-token weight does not shrink with length).
    - ``seq-mean-token-mean``: per-sequence mean, then mean over sequences (original GRPO).

    Sequences with no counted token are not counted in the sequence mean. ``denominator``
    replaces the token count (token-mean) or sequence count (seq-mean-*): pass the global count
    over all micro-batches and ranks so that summing the micro-batch losses gives the loss of the
    whole batch.
    """
    m = _bool(mask)
    kept = torch.where(m, values, torch.zeros_like(values))
    tokens_per_row = m.to(values.dtype).sum(-1)
    if agg == "token-mean":
        total = kept.sum()
        count = tokens_per_row.sum()
    elif agg == "seq-mean-token-sum":
        total = kept.sum()
        count = (tokens_per_row > 0).to(values.dtype).sum()
    elif agg == "seq-mean-token-mean":
        total = (kept.sum(-1) / _safe(tokens_per_row)).sum()
        count = (tokens_per_row > 0).to(values.dtype).sum()
    else:
        raise ValueError(
            f"unknown agg {agg!r}; use one of token-mean, seq-mean-token-sum, seq-mean-token-mean"
        )
    if denominator is not None:
        count = torch.as_tensor(denominator, dtype=values.dtype, device=values.device)
    return total / _safe(count)


# ---------------------------------------------------------------------------------------------
# importance weights (all detached)


def _log_ratio(logp_num: Tensor, logp_den: Tensor, mask: Tensor) -> Tensor:
    """Token log-ratio, 0 at masked-out positions so that padding never overflows an exp."""
    diff = logp_num.detach() - logp_den.detach()
    return torch.where(_bool(mask), diff, torch.zeros_like(diff))


def _unit_log_ratio(log_ratio: Tensor, mask: Tensor, level: Level) -> tuple[Tensor, Tensor]:
    """Log-ratio per unit of correction, broadcast to [B, T], and the mask of units to count.

    token: each token; sequence: sum over the sequence's tokens (the product of token ratios);
    geometric: mean over its tokens (the geometric mean of token ratios, length-independent).
    """
    m = _bool(mask)
    if level == "token":
        return log_ratio, m
    if level not in ("sequence", "geometric"):
        raise ValueError(f"unknown level {level!r}; use token, sequence or geometric")
    per_seq = log_ratio.sum(-1) if level == "sequence" else masked_mean(log_ratio, m, dim=-1)
    return per_seq.unsqueeze(-1).expand_as(log_ratio), m.any(-1, keepdim=True).expand_as(m)


def _unit_mean(x: Tensor, mask: Tensor, unit_mask: Tensor, level: Level) -> Tensor:
    """Mean over tokens (token level) or over sequences (sequence levels).

    At sequence levels ``x`` must hold its sequence's value at every position (also masked ones).
    """
    if level == "token":
        return masked_mean(x, mask)
    return masked_mean(x[:, 0], unit_mask[:, 0])


@torch.no_grad()
def truncated_is(
    logp_old: Tensor,
    logp_behaviour: Tensor,
    mask: Tensor,
    cap: float,
    level: Level = "token",
) -> tuple[Tensor, Stats]:
    """Truncated importance sampling: ``w = min(pi_old / mu, cap)``.

    Token level: one ratio per token. Sequence level: ``exp(sum_t log(pi_old/mu))`` per sequence,
    capped, broadcast to its tokens. Geometric: the per-token geometric mean of that product.
    Returns (weights [B, T], 0 at masked positions; stats: ``mean`` of the applied weights,
    ``max`` of the raw ratio, ``frac_clipped`` units whose ratio exceeded the cap).
    """
    if not cap > 0:
        raise ValueError(f"the truncation cap must be positive, got {cap}")
    m = _bool(mask)
    log_r, unit_mask = _unit_log_ratio(_log_ratio(logp_old, logp_behaviour, m), m, level)
    # compare in log space: a long sequence's product ratio can overflow exp
    clipped = log_r > math.log(cap)
    w_unit = torch.exp(torch.clamp(log_r, max=math.log(cap)))
    w = torch.where(m, w_unit, torch.zeros_like(w_unit))
    stats = {
        "mean": _unit_mean(w_unit, m, unit_mask, level),
        "max": torch.exp(masked_max(log_r, unit_mask)),
        "frac_clipped": _unit_mean(clipped.to(w.dtype), m, unit_mask, level),
    }
    return w, stats


def _band_mask(
    log_r: Tensor, mask: Tensor, unit_mask: Tensor, low: float, high: float, level: Level
) -> tuple[Tensor, Stats]:
    if not 0 < low <= high:
        raise ValueError(f"the ratio band needs 0 < low <= high, got low={low}, high={high}")
    ratio = torch.exp(log_r)
    inside = (ratio >= low) & (ratio <= high)
    keep = mask & inside
    stats = {
        "mean": _unit_mean(ratio, mask, unit_mask, level),
        "max": masked_max(ratio, unit_mask),
        "frac_masked": _unit_mean((~inside).to(ratio.dtype), mask, unit_mask, level),
    }
    return keep, stats


@torch.no_grad()
def masked_is(
    logp_old: Tensor,
    logp_behaviour: Tensor,
    mask: Tensor,
    low: float,
    high: float,
    level: Level = "token",
) -> tuple[Tensor, Stats]:
    """Masked importance sampling: keep units whose ratio ``pi_old / mu`` lies in [low, high].

    Kept tokens get weight 1; tokens (token level) or whole sequences (sequence levels) outside
    the band are dropped. Returns (the new loss mask [B, T] with ``mask``'s dtype, to be used in
    place of ``mask``; stats: ``mean`` and ``max`` of the raw ratio, ``frac_masked``).
    """
    m = _bool(mask)
    log_r, unit_mask = _unit_log_ratio(_log_ratio(logp_old, logp_behaviour, m), m, level)
    keep, stats = _band_mask(log_r, m, unit_mask, low, high, level)
    return keep.to(mask.dtype), stats


@torch.no_grad()
def mismatch_token_mask(
    logp_train: Tensor,
    logp_behaviour: Tensor,
    mask: Tensor,
    low: float,
    high: float,
) -> tuple[Tensor, Stats]:
    """Train/inference mismatch masking: drop single tokens with ``pi_train / mu`` outside [low, high].

    ``logp_train`` is the learner's own recomputation of the sampled tokens' logprobs; a token
    where it disagrees too much with the engine's is treated as a numerical accident and not
    trained on. Returns (the new loss mask; stats as ``masked_is``).
    """
    m = _bool(mask)
    log_r = _log_ratio(logp_train, logp_behaviour, m)
    keep, stats = _band_mask(log_r, m, m, low, high, "token")
    return keep.to(mask.dtype), stats


@torch.no_grad()
def mismatch_kl(logp_train: Tensor, logp_behaviour: Tensor, mask: Tensor) -> Stats:
    """KL(mu || pi_train) estimated on the sampled tokens (which are drawn from mu), token-mean.

    ``k1 = E[log mu - log pi]`` (unbiased, can be negative); ``k3 = E[r - 1 - log r]`` with
    ``r = pi / mu`` (unbiased, always >= 0, lower variance). Schulman's "Approximating KL".
    """
    log_r = _log_ratio(logp_train, logp_behaviour, mask)
    return {
        "k1": masked_mean(-log_r, mask),
        "k3": masked_mean(torch.exp(log_r) - 1 - log_r, mask),
    }


@torch.no_grad()
def approx_proximal_logp(
    logp_behaviour: Tensor,
    logp_current_detached: Tensor,
    token_versions: Tensor,
    current_version: int,
    proximal_version: int,
) -> Tensor:
    """Proximal-policy logprobs without a forward pass, by log-linear interpolation in version.

    ``alpha = clamp((proximal_version - v) / (current_version - v), 0, 1)`` with ``v`` the policy
    version that sampled the token, and ``logp_prox = logp_behaviour + alpha * (logp_current -
    logp_behaviour)``; tokens sampled at ``current_version`` (or later) take the current logprob.
    Assumes each token's logprob moves linearly in version between the behaviour policy and the
    current one. Exact at the endpoints (v == proximal_version gives the behaviour logprob,
    proximal_version == current_version the current one).
    """
    if proximal_version > current_version:
        raise ValueError(
            f"proximal_version {proximal_version} is newer than current_version {current_version}; "
            "the proximal policy must lie between the behaviour and the current policy"
        )
    lb = logp_behaviour.detach()
    lc = logp_current_detached.detach()
    v = token_versions.to(lb.dtype)
    span = current_version - v
    alpha = ((proximal_version - v) / _safe(span)).clamp(0.0, 1.0)
    alpha = torch.where(span > 0, alpha, torch.ones_like(alpha))
    return lb + alpha * (lc - lb)


# ---------------------------------------------------------------------------------------------
# losses (gradient flows through ``logp`` only)


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    a = advantages.detach().to(like.dtype)
    return a.unsqueeze(-1) if a.dim() == 1 else a


def policy_gradient_loss(
    logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    is_weights: Tensor | None = None,
    agg: Agg = "token-mean",
    denominator: float | Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """REINFORCE / single-step GRPO: ``loss = agg(-(w * A * logp))``, w detached (1 if None)."""
    a = _per_token(advantages, logp)
    per_token = -a * logp
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, mask, agg, denominator)
    stats = {"tokens": _bool(mask).sum().to(logp.dtype).detach()}
    return loss, stats


def ppo_clip_loss(
    logp: Tensor,
    logp_prox: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_weights: Tensor | None = None,
    agg: Agg = "token-mean",
    denominator: float | Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """PPO clipped objective against a proximal policy, optionally importance-weighted.

    ``r = exp(logp - logp_prox)``; per token ``-w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``.
    ``clip_high > clip_low`` is DAPO's clip-higher. Stats: ``clip_frac`` (tokens whose clipped
    term is strictly the smaller, i.e. that get no gradient), split into ``clip_frac_high``
    (A > 0, r > 1 + clip_high) and ``clip_frac_low`` (A < 0, r < 1 - clip_low); ``ratio_mean``,
    ``ratio_max``.
    """
    m = _bool(mask)
    a = _per_token(advantages, logp)
    log_r = logp - logp_prox.detach()
    log_r = torch.where(m, log_r, torch.zeros_like(log_r))
    ratio = torch.exp(log_r)
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * a
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, m, agg, denominator)
    with torch.no_grad():
        high = (a > 0) & (ratio > 1.0 + clip_high)
        low = (a < 0) & (ratio < 1.0 - clip_low)
        r = ratio.detach()
        stats = {
            "clip_frac": masked_mean((high | low).to(r.dtype), m),
            "clip_frac_high": masked_mean(high.to(r.dtype), m),
            "clip_frac_low": masked_mean(low.to(r.dtype), m),
            "ratio_mean": masked_mean(r, m),
            "ratio_max": masked_max(r, m),
        }
    return loss, stats


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
    agg: Agg = "token-mean",
    denominator: float | Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """Decoupled PPO (AReaL): ``-(pi_prox / mu) * min(r * A, clip(r) * A)``, ``r = pi_theta / pi_prox``.

    The trust region is taken around the proximal policy, and the detached factor ``pi_prox / mu``
    corrects for the tokens having been sampled by the behaviour policy mu. With ``is_cap`` the
    factor is truncated at the cap (``truncate``) or, as in AReaL's ``behav_imp_weight_cap``,
    tokens above the cap get weight 0 (``mask``; they still count in the denominator). Stats:
    those of ``ppo_clip_loss`` plus ``is_mean``, ``is_max`` (raw), ``is_frac_capped``.
    """
    m = _bool(mask)
    with torch.no_grad():
        raw = torch.exp(_log_ratio(logp_prox, logp_behaviour, m))
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
    loss, stats = ppo_clip_loss(logp, logp_prox, advantages, m, clip_low, clip_high, w, agg, denominator)
    stats["is_mean"] = masked_mean(w, m)
    stats["is_max"] = masked_max(raw, m)
    stats["is_frac_capped"] = masked_mean(capped.to(w.dtype), m)
    return loss, stats


# ---------------------------------------------------------------------------------------------
# config-facing dispatcher


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
    denominator: float | Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """One entry point for the config's ``loss.kind`` x ``loss.correction``.

    ``logp_old`` is the learner's detached logprob under the weights at the start of this step
    (pi_old, which decoupled PPO calls pi_prox; ``approx_proximal_logp`` can stand in for it);
    ``None`` means ``logp.detach()``, right for a single gradient step per batch. All corrections
    compare it with the behaviour logprob mu:

    - ``none``: no weight (``decoupled_ppo`` still applies its uncapped pi_old / mu);
    - ``tis``: weight ``min(pi_old / mu, tis_cap)`` at ``level``;
    - ``mis``: drop units whose ratio leaves [mis_low, mis_high]; ``pg``/``ppo`` give kept tokens
      weight 1, ``decoupled_ppo`` keeps its weight pi_old / mu on them.

    ``mismatch_band`` additionally drops single tokens whose pi_old / mu leaves the band. Stats
    are prefixed ``loss/``, ``is/``, ``mismatch/`` and include the mismatch KL.
    """
    if logp_old is None:
        logp_old = logp.detach()
    logp_old = logp_old.detach()
    mask = _bool(mask)
    stats: Stats = {}

    # measured before any masking, so the metric shows the mismatch that the masks act on
    stats.update({f"mismatch/kl_{k}": v for k, v in mismatch_kl(logp_old, logp_behaviour, mask).items()})
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

    if kind == "pg":
        loss, s = policy_gradient_loss(logp, advantages, mask, weights, agg, denominator)
    elif kind == "ppo" or (kind == "decoupled_ppo" and weights is not None):
        # decoupled PPO with TIS is PPO around pi_old weighted by the truncated pi_old / mu
        loss, s = ppo_clip_loss(
            logp, logp_old, advantages, mask, clip_low, clip_high, weights, agg, denominator
        )
    elif kind == "decoupled_ppo":
        # none / mis: the uncapped pi_old / mu on the tokens still in the mask
        loss, s = decoupled_ppo_loss(
            logp,
            logp_old,
            logp_behaviour,
            advantages,
            mask,
            clip_low,
            clip_high,
            agg=agg,
            denominator=denominator,
        )
    else:
        raise ValueError(f"unknown loss kind {kind!r}; use pg, ppo or decoupled_ppo")
    stats.update({f"loss/{k}": v for k, v in s.items()})
    stats["loss/loss"] = loss.detach()
    return loss, stats
