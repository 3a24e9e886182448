"""Off-policy corrections: importance weights and masks comparing the learner with the engine.

Role: everything computed from the learner's pi_old and the engine's behaviour logprob mu (and,
for the proximal approximation, the token versions): truncated and masked importance sampling
at token, sequence or geometric level, single-token mismatch masking, the mismatch KL, and the
version-interpolated proximal policy. Formulas and settings: docs/losses.md.

Invariants: every function here is computed without gradient (inputs detached, outputs
detached); ratios are taken in log space and masked positions enter as 0, so padding never
overflows an exp; stats are detached 0-dim tensors (no ``.item()``, no device sync).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from agentrl.learner.masked import as_bool, masked_max, masked_mean, safe

__all__ = [
    "Level",
    "Stats",
    "approx_proximal_logp",
    "log_ratio",
    "masked_is",
    "mismatch_kl",
    "mismatch_spread",
    "mismatch_token_mask",
    "truncated_is",
]

Level = Literal["token", "sequence", "geometric"]
Stats = dict[str, Tensor]


# ---------------------------------------------------------------------------------------------
# importance weights (all detached)


def log_ratio(logp_num: Tensor, logp_den: Tensor, mask: Tensor) -> Tensor:
    """Token log-ratio, 0 at masked-out positions so that padding never overflows an exp."""
    diff = logp_num.detach() - logp_den.detach()
    return torch.where(as_bool(mask), diff, torch.zeros_like(diff))


def _unit_log_ratio(log_r: Tensor, mask: Tensor, level: Level) -> tuple[Tensor, Tensor]:
    """Log-ratio per unit of correction, broadcast to [B, T], and the mask of units to count.

    token: each token; sequence: sum over the sequence's tokens (the product of token ratios);
    geometric: mean over its tokens (the geometric mean of token ratios, length-independent).
    """
    m = as_bool(mask)
    if level == "token":
        return log_r, m
    if level not in ("sequence", "geometric"):
        raise ValueError(f"unknown level {level!r}; use token, sequence or geometric")
    per_seq = log_r.sum(-1) if level == "sequence" else masked_mean(log_r, m, dim=-1)
    return per_seq.unsqueeze(-1).expand_as(log_r), m.any(-1, keepdim=True).expand_as(m)


def _unit_mean(x: Tensor, mask: Tensor, unit_mask: Tensor, level: Level) -> Tensor:
    """Mean over tokens (token level) or over sequences (sequence levels).

    At sequence levels ``x`` must hold its sequence's value at every position (also masked ones).
    """
    if level == "token":
        return masked_mean(x, mask)
    return masked_mean(x[:, 0], unit_mask[:, 0])


@torch.no_grad()
def truncated_is(logp_old: Tensor, logp_behaviour: Tensor, mask: Tensor, cap: float,
                 level: Level = "token") -> tuple[Tensor, Stats]:
    """Truncated importance sampling: ``w = min(pi_old / mu, cap)``.

    Token level: one ratio per token. Sequence level: ``exp(sum_t log(pi_old/mu))`` per sequence,
    capped, broadcast to its tokens. Geometric: the per-token geometric mean of that product.
    Returns (weights [B, T], 0 at masked positions; stats: ``mean`` of the applied weights,
    ``max`` of the raw ratio, ``frac_clipped`` units whose ratio exceeded the cap).
    """
    if not cap > 0:
        raise ValueError(f"the truncation cap must be positive, got {cap}")
    m = as_bool(mask)
    log_r, unit_mask = _unit_log_ratio(log_ratio(logp_old, logp_behaviour, m), m, level)
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
def masked_is(logp_old: Tensor, logp_behaviour: Tensor, mask: Tensor, low: float, high: float,
              level: Level = "token") -> tuple[Tensor, Stats]:
    """Masked importance sampling: keep units whose ratio ``pi_old / mu`` lies in [low, high].

    Kept tokens get weight 1; tokens (token level) or whole sequences (sequence levels) outside
    the band are dropped. Returns (the new loss mask [B, T] with ``mask``'s dtype, to be used in
    place of ``mask``; stats: ``mean`` and ``max`` of the raw ratio, ``frac_masked``).
    """
    m = as_bool(mask)
    log_r, unit_mask = _unit_log_ratio(log_ratio(logp_old, logp_behaviour, m), m, level)
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
    m = as_bool(mask)
    log_r = log_ratio(logp_train, logp_behaviour, m)
    keep, stats = _band_mask(log_r, m, m, low, high, "token")
    return keep.to(mask.dtype), stats


@torch.no_grad()
def mismatch_kl(logp_train: Tensor, logp_behaviour: Tensor, mask: Tensor) -> Stats:
    """KL(mu || pi_train) estimated on the sampled tokens (which are drawn from mu), token-mean.

    ``k1 = E[log mu - log pi]`` (unbiased, can be negative); ``k3 = E[r - 1 - log r]`` with
    ``r = pi / mu`` (unbiased, always >= 0, lower variance). Schulman's "Approximating KL".
    """
    log_r = log_ratio(logp_train, logp_behaviour, mask)
    return {
        "k1": masked_mean(-log_r, mask),
        "k3": masked_mean(torch.exp(log_r) - 1 - log_r, mask),
    }


@torch.no_grad()
def mismatch_spread(logp_train: Tensor, logp_behaviour: Tensor, mask: Tensor) -> Stats:
    """How far the learner's logprobs are from the engine's on the sampled tokens, before any
    correction: ``abs_log_ratio`` = E|log pi - log mu| (token-mean) and ``ratio_std``, the standard
    deviation of the importance weights pi / mu (1 and 0 when they agree exactly)."""
    log_r = log_ratio(logp_train, logp_behaviour, mask)
    ratio = torch.exp(log_r)
    mean = masked_mean(ratio, mask)
    return {
        "abs_log_ratio": masked_mean(log_r.abs(), mask),
        "ratio_std": torch.sqrt(masked_mean((ratio - mean) ** 2, mask)),
    }


@torch.no_grad()
def approx_proximal_logp(
    logp_behaviour: Tensor,
    logp_current_detached: Tensor,
    token_versions: Tensor,
    current_version: float,
    proximal_version: float,
) -> Tensor:
    """Proximal-policy logprobs without a forward pass, by log-linear interpolation in version.

    ``alpha = clamp((proximal_version - v) / (current_version - v), 0, 1)`` with ``v`` the policy
    version that sampled the token, and ``logp_prox = logp_behaviour + alpha * (logp_current -
    logp_behaviour)``; tokens sampled at ``current_version`` (or later) take the current logprob.
    Assumes each token's logprob moves linearly in version between the behaviour policy and the
    current one. Exact at the endpoints (v == proximal_version gives the behaviour logprob,
    proximal_version == current_version the current one). Versions may be fractional: the
    learner's k-th of U optimizer updates within one step is at ``version + k / U``.
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
    alpha = ((proximal_version - v) / safe(span)).clamp(0.0, 1.0)
    alpha = torch.where(span > 0, alpha, torch.ones_like(alpha))
    return lb + alpha * (lc - lb)
