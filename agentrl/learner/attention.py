"""Attention over a packed row, one sample at a time: no [N, N] mask, work and memory linear in N.

Role: the learner packs samples into rows (:mod:`agentrl.learner.packing`) and calls the model with
``attention_mask=None`` and position ids that restart at 0 for each sample. transformers' ``sdpa``
then builds a block-diagonal causal mask of the whole row, [N, N], and attends over all of it: at
16k tokens that is 256M mask entries per forward and attention work that grows with N squared,
although every sample attends only to itself. :data:`PACKED` is the same attention (transformers'
own sdpa function) run causally on each sample's span of the row, found from the position ids.

Invariants:
- Each sample's output is what ``sdpa`` gives with the block-diagonal mask (the same kernel on the
  same numbers, to fp32 rounding); ``tests/test_learner_attention.py`` checks it against ``sdpa``.
- A call with a padding mask (the right-padded layout, ``packing.token_logprobs``), with a cache,
  with more than one row, or without position ids is plain ``sdpa`` with transformers' own mask.
- Only models loaded with ``sdpa`` are switched (:func:`use_packed_attention`); flash-attention
  kernels read the sample boundaries themselves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED = "agentrl_packed_sdpa"


def packed_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``query``/``key``/``value``: [1, heads, N, head_dim]; returns [1, N, heads, head_dim] like sdpa."""
    n = query.shape[2]
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or key.shape[2] != n:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    starts = (position_ids.reshape(-1)[:n] == 0).nonzero().flatten().tolist()
    if starts[:1] != [0]:  # a row must open a sample; anything else is not a packed row
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if len(starts) == 1:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    bounds = [*starts, n]
    spans = [
        sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **kwargs)[0]
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    return torch.cat(spans, dim=1), None


def _packed_mask(*args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """No mask for a packed row (:func:`packed_sdpa` splits it); sdpa's mask for a padded batch."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(PACKED, packed_sdpa)
AttentionMaskInterface.register(PACKED, _packed_mask)


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch a model loaded with ``sdpa`` to :data:`PACKED`; True if it was switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(PACKED)
    return True
