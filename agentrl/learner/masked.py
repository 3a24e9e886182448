"""Masked reductions and loss aggregation: pure functions of torch tensors.

Role: every sum, mean and max the losses and corrections take over the tokens that count, and the
aggregations that turn per-token loss values into one scalar (``learn.loss.agg``, docs/losses.md).

Invariants:
- ``mask`` (bool or 0/1 float, [B, T]) is true exactly on the tokens that count; anything at a
  masked-out position (padding, prompt, tool output, even inf/NaN) never reaches a result or a
  gradient.
- Nothing selected gives 0, never NaN, in the value and in the gradient.
- :func:`aggregate` with ``denominator=1`` is the sum form of the aggregation; :func:`loss_units`
  counts what the sum is divided by, so a caller that splits a batch over micro-batches and ranks
  can sum the parts first and divide once by the global count.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "AGGS",
    "Agg",
    "aggregate",
    "as_bool",
    "loss_units",
    "masked_max",
    "masked_mean",
    "masked_sum",
    "safe",
]

Agg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGS: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask > 0


def safe(denominator: Tensor) -> Tensor:
    # Dividing 0 by a safe 1 keeps both the value and the gradient finite where nothing counts;
    # torch.where(d > 0, x / d, 0) would still backpropagate NaN through the untaken branch.
    return torch.where(denominator > 0, denominator, torch.ones_like(denominator))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask``; masked-out entries are dropped even if inf or NaN."""
    kept = torch.where(as_bool(mask), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask``; 0 (not NaN) where nothing is selected."""
    count = as_bool(mask).to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(values, mask, dim) / safe(count)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max of ``values`` where ``mask``; 0 where nothing is selected."""
    m = as_bool(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return zero
    # no boolean indexing and no .item(): stays on the device without a host sync
    top = torch.where(m, values, torch.full_like(values, -math.inf)).max()
    return torch.where(m.any(), top, zero)


def loss_units(mask: Tensor, agg: Agg = "token-mean", norm_tokens: float = 0.0) -> Tensor:
    """What ``aggregate`` divides its sum by: counted tokens (``token-mean``), sequences with at
    least one counted token (``seq-mean-*``), or those sequences times ``norm_tokens``
    (``seq-mean-token-sum-norm``; 0: the mask's width, i.e. the longest sample here)."""
    m = as_bool(mask)
    if agg == "token-mean":
        return m.sum().to(torch.float64)
    sequences = m.any(-1).sum().to(torch.float64)
    if agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return sequences
    if agg == "seq-mean-token-sum-norm":
        return sequences * float(norm_tokens or m.shape[-1])
    raise ValueError(f"unknown agg {agg!r}; use one of {', '.join(AGGS)}")


def aggregate(
    values: Tensor,
    mask: Tensor,
    agg: Agg = "token-mean",
    denominator: float | Tensor | None = None,
    norm_tokens: float = 0.0,
) -> Tensor:
    """Reduce per-token ``values`` [B, T] to a scalar.

    - ``token-mean``: sum over all counted tokens / number of counted tokens. Every token weighs
      the same, so long completions weigh more (DAPO's token-level loss).
    - ``seq-mean-token-sum``: per-sequence sum, then mean over sequences (no length
      normalisation; the per-token weight does not shrink with length).
    - ``seq-mean-token-mean``: per-sequence mean, then mean over sequences (original GRPO).
    - ``seq-mean-token-sum-norm``: per-sequence sum divided by a constant length ``norm_tokens``,
      then mean over sequences (Dr. GRPO: every token of every sequence weighs the same
      ``1 / (sequences x norm_tokens)``, whatever the sequence's length).

    Sequences with no counted token are not counted in the sequence mean. ``denominator``
    replaces :func:`loss_units` (the local count): pass the global count over all micro-batches
    and ranks so that summing the micro-batch losses gives the loss of the whole batch, or 1 for
    the sum form.
    """
    m = as_bool(mask)
    kept = torch.where(m, values, torch.zeros_like(values))
    if agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        total = kept.sum()
    elif agg == "seq-mean-token-mean":
        tokens_per_row = m.to(values.dtype).sum(-1)
        total = (kept.sum(-1) / safe(tokens_per_row)).sum()
    else:
        raise ValueError(f"unknown agg {agg!r}; use one of {', '.join(AGGS)}")
    if denominator is None:
        count = loss_units(m, agg, norm_tokens).to(values.dtype).to(values.device)
    else:
        count = torch.as_tensor(denominator, dtype=values.dtype, device=values.device)
    return total / safe(count)
