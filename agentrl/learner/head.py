"""The LM head in chunks of tokens: per-token logprobs, entropy and teacher top-k terms without ever
holding a [tokens, vocabulary] tensor.

Role: :func:`row_terms` runs the model over one packed row, takes the final hidden states [R, H]
(after the final norm) instead of the logits, and computes per position, over the vocabulary:

- ``logp`` [R]: the next token's logprob under the behaviour distribution the engine sampled from
  (:mod:`agentrl.learner.replay`: penalties, temperature, the recorded kept set);
- ``entropy`` [R]: that distribution's entropy (a statistic of the step);
- ``topk`` [R, k]: the plain log-softmax (temperature 1, the whole vocabulary) at the teacher's
  top-k ids, 0 where an id is < 0 (the forward KL of top-k distillation).

:class:`ChunkedHead` applies the head to ``chunk_tokens`` positions at a time, in forward and again
in backward (which recomputes each chunk's logits from the saved hidden states and accumulates the
gradients of the hidden states and of the head's weight), so the learner's memory grows with
tokens x hidden, not tokens x vocabulary: SmolLM2-135M's vocabulary of 49,152 made each [8192, V]
fp32 tensor 1.6 GB, and the unchunked path kept several of them for backward (docs/learner.md).

Invariants:
- The terms and their gradients are those of the unchunked computation (:func:`full_terms` on the
  whole row's logits: ``replayed_logprobs`` and the top-k log-softmax) to fp32 rounding; at most one
  chunk's [chunk, V] logits and a few temporaries of that size exist at once.
- Everything is fp32, as the unchunked path (the learner's head weight is fp32, ``dist.load_model``).
- The chunked path needs a plain ``nn.Linear`` head whose weight is a whole tensor after the model's
  forward. Under FSDP2 it is: the root module (which holds the head and the tied embedding) does not
  reshard after forward, so the weight read then is the unsharded parameter, and the gradient
  accumulated into it is reduce-scattered by FSDP's post-backward like any other. A tied head is the
  embedding's parameter: both gradients accumulate into it. Any other head (LoRA on the head) takes
  the unchunked path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from agentrl.learner.replay import RowReplay, check_vocab, penalised, replayed_log_softmax, replayed_logprobs

if TYPE_CHECKING:
    from torch.autograd.function import FunctionCtx

CHUNK_TOKENS = 1024
"""Default positions per chunk. Each chunk holds about three [chunk, V] fp32 tensors at once (the
logits, their exponentials, a temporary): 0.6 GB for SmolLM2's 49,152-token vocabulary, 1.9 GB for a
152k vocabulary; the head's matmuls stay large enough to run at full speed (benchmarks/learner_memory.py)."""

_NO_LOGITS = torch.empty(0, dtype=torch.long)  # logits_to_keep: the model computes no logits at all


@dataclass
class Terms:
    """Per-position results of one packed row of R + 1 tokens (position j predicts token j + 1)."""

    logp: Tensor  # [R]
    entropy: Tensor  # [R]
    topk: Tensor | None = None  # [R, k]


def row_terms(model: torch.nn.Module, ids: Tensor, pos: Tensor, plan: RowReplay,
              topk_ids: Tensor | None = None, chunk_tokens: int = CHUNK_TOKENS) -> Terms:
    """Run ``model`` on one packed row (``ids``, ``pos``: [1, N]) and compute its :class:`Terms`
    (``topk_ids`` [N-1, k]: the teacher's top-k at each position, -1 where none), the head in
    chunks of ``chunk_tokens`` positions (0: the whole row's logits at once, the unchunked path)."""
    head = model.get_output_embeddings() if chunk_tokens > 0 else None
    if type(head) is not torch.nn.Linear:
        logits = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits
        return full_terms(logits[0, :-1], ids[0, 1:], plan, topk_ids)
    out = model(
        input_ids=ids,
        position_ids=pos,
        attention_mask=None,
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=_NO_LOGITS.to(ids.device),
    )
    weight = head.weight
    if type(weight) is not torch.nn.Parameter and type(weight) is not Tensor:  # e.g. a DTensor shard
        raise RuntimeError(f"the LM head's weight is a {type(weight).__name__} after the forward, not a "
                           "whole tensor; set learn.head_chunk_tokens = 0 to compute the logits unchunked")
    hidden = out.hidden_states[-1][0, :-1]  # the final norm's output: what the head maps to logits
    return chunked_terms(hidden, weight, head.bias, ids[0, 1:], plan, topk_ids, chunk_tokens)


def chunked_terms(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, plan: RowReplay,
                  topk_ids: Tensor | None = None, chunk_tokens: int = CHUNK_TOKENS) -> Terms:
    """:class:`Terms` of the logits ``hidden @ weight.T + bias`` ([R, H] -> [R, V]), ``chunk_tokens``
    positions at a time (:class:`ChunkedHead`)."""
    check_vocab(weight.shape[0], plan)
    ids = topk_ids if topk_ids is not None else torch.empty((hidden.shape[0], 0), dtype=torch.long,
                                                            device=hidden.device)
    logp, entropy, topk = ChunkedHead.apply(hidden, weight, bias, targets, ids, plan, max(1, chunk_tokens))
    return Terms(logp, entropy, topk if topk_ids is not None else None)


def full_terms(logits: Tensor, targets: Tensor, plan: RowReplay, topk_ids: Tensor | None = None) -> Terms:
    """:class:`Terms` from the whole row's logits [R, V] (the unchunked path and the reference the
    chunked one is tested against). Its entropy is a statistic only: computed without gradient, so
    that no second [R, V] tensor is kept for backward."""
    z = logits.float()
    if plan.empty:
        logp = torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    else:
        logp = replayed_logprobs(z, targets, plan)
    with torch.no_grad():
        entropy = full_entropy(z, plan)
    topk = None
    if topk_ids is not None:
        picked = z.gather(-1, topk_ids.clamp(min=0)) - torch.logsumexp(z, dim=-1, keepdim=True)
        topk = torch.where(topk_ids >= 0, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
    return Terms(logp, entropy, topk)


def full_entropy(logits: Tensor, plan: RowReplay) -> Tensor:
    """The behaviour distribution's entropy [R] from the whole row's logits [R, V] (differentiable)."""
    logq = replayed_log_softmax(logits.float(), plan)
    q = logq.exp()
    return -(q * torch.where(q > 0, logq, torch.zeros_like(logq))).sum(-1)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.nn.functional.linear(h.float(), weight.float(), None if bias is None else bias.float())


def _behaviour_(z: Tensor, plan: RowReplay) -> Tensor | None:
    """Penalties and temperature applied to the chunk's logits ``z`` in place (no second [C, V]
    tensor); the penalties' slopes at their (position, token) pairs, for backward."""
    slope = None
    if plan.pen_rows is not None:
        zp, slope = penalised(z[plan.pen_rows, plan.pen_cols], plan)
        z.index_put_((plan.pen_rows, plan.pen_cols), zp)
    if plan.temperature is not None:
        z.div_(plan.temperature.unsqueeze(-1))
    return slope


def _outside(plan: RowReplay, shape: torch.Size, device: torch.device) -> Tensor | None:
    """[C, V] bool: true at the tokens outside a position's recorded kept set (None: no kept set)."""
    if plan.kept_rows is None:
        return None
    assert plan.kept_ids is not None and plan.kept_valid is not None
    out = torch.zeros(shape, dtype=torch.bool, device=device)
    out[plan.kept_rows] = True
    r, c = torch.nonzero(plan.kept_valid, as_tuple=True)
    out[plan.kept_rows[r], plan.kept_ids[r, c]] = False
    return out


class ChunkedHead(torch.autograd.Function):
    """Fused linear head + replayed log-softmax, entropy and top-k log-softmax, chunk by chunk.

    Forward keeps the hidden states, the weight and per-position results (log-normalisers, entropy);
    backward recomputes each chunk's logits. With ``q`` the behaviour distribution over its support
    (the kept set, or the vocabulary) at logits ``z' = penalise(z) / T`` and ``t`` the target:
    ``d logp / d z'_j = [j = t] - q_j``, ``d H / d z'_j = -q_j (log q_j + H)``; through the
    temperature ``/ T`` and the penalties' slopes; and for the top-k term ``z_i - lse(z)`` at raw
    logits, ``[j = i] - softmax(z)_j``.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        topk_ids: Tensor,
        plan: RowReplay,
        chunk: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        rows = hidden.shape[0]
        logp = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        entropy, lse, lse_raw = torch.empty_like(logp), torch.empty_like(logp), torch.empty_like(logp)
        topk = torch.zeros(topk_ids.shape, dtype=torch.float32, device=hidden.device)
        plans = []
        for a in range(0, rows, chunk):
            b = min(rows, a + chunk)
            sub = plan.rows(a, b)
            plans.append(sub)
            z = _logits(hidden[a:b], weight, bias)
            if topk_ids.shape[1]:
                lse_raw[a:b] = torch.logsumexp(z, dim=-1)
                ids = topk_ids[a:b]
                picked = z.gather(-1, ids.clamp(min=0)) - lse_raw[a:b].unsqueeze(-1)
                topk[a:b] = torch.where(ids >= 0, picked, torch.zeros((), dtype=z.dtype, device=z.device))
            _behaviour_(z, sub)
            # before the kept set, as replay takes it
            zt = z.gather(-1, targets[a:b].unsqueeze(-1)).squeeze(-1)
            outside = _outside(sub, z.shape, z.device)
            if outside is not None:
                z.masked_fill_(outside, float("-inf"))
            lse[a:b] = torch.logsumexp(z, dim=-1)
            logp[a:b] = zt - lse[a:b]
            z.sub_(lse[a:b].unsqueeze(-1))  # log q
            q = z.exp()
            if outside is not None:
                z.masked_fill_(outside, 0.0)  # q is 0 there: 0 * log q counts 0, not NaN
            entropy[a:b] = -(q * z).sum(-1)
            del z, q, outside
        ctx.save_for_backward(hidden, weight, bias, targets, topk_ids, lse, lse_raw, entropy)
        ctx.plans, ctx.chunk = plans, chunk
        ctx.set_materialize_grads(False)
        return logp, entropy, topk

    @staticmethod
    def backward(ctx: FunctionCtx, g_logp: Tensor | None, g_entropy: Tensor | None,
                 g_topk: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, topk_ids, lse, lse_raw, entropy = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b else None
        if g_topk is not None and not topk_ids.shape[1]:
            g_topk = None
        for n, a in enumerate(range(0, hidden.shape[0], ctx.chunk)):
            b = min(hidden.shape[0], a + ctx.chunk)
            sub: RowReplay = ctx.plans[n]
            h = hidden[a:b].float()
            z = _logits(h, weight, bias)
            grad = None
            if g_topk is not None:  # raw logits: d(z_i - lse(z)) = onehot(i) - softmax(z)
                ids = topk_ids[a:b]
                g = torch.where(
                    ids >= 0, g_topk[a:b], torch.zeros((), dtype=g_topk.dtype, device=g_topk.device)
                )
                grad = torch.exp(z - lse_raw[a:b].unsqueeze(-1))
                grad.mul_(-g.sum(-1, keepdim=True)).scatter_add_(-1, ids.clamp(min=0), g)
            if g_logp is not None or g_entropy is not None:
                gq = _behaviour_grad(z, sub, targets[a:b], lse[a:b], entropy[a:b],
                                     None if g_logp is None else g_logp[a:b],
                                     None if g_entropy is None else g_entropy[a:b])
                grad = gq if grad is None else grad.add_(gq)
                del gq
            del z
            if grad is None:
                continue
            if grad_h is not None:
                grad_h[a:b] = (grad @ weight.float()).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(grad.t(), h)
            if grad_b is not None:
                grad_b += grad.sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


def _behaviour_grad(z: Tensor, plan: RowReplay, targets: Tensor, lse: Tensor, entropy: Tensor,
                    g_logp: Tensor | None, g_entropy: Tensor | None) -> Tensor:
    """The gradient wrt the raw logits ``z`` [C, V] (overwritten) of ``g_logp . logp + g_entropy . H``:
    ``g_logp [j = t] - q_j (g_logp + g_entropy (log q_j + H))`` wrt ``z'``, then through ``/ T`` and
    the penalties' slopes."""
    slope = _behaviour_(z, plan)
    outside = _outside(plan, z.shape, z.device)
    if outside is not None:
        z.masked_fill_(outside, float("-inf"))
    z.sub_(lse.unsqueeze(-1))  # log q
    q = z.exp()
    if g_entropy is not None:
        if outside is not None:
            z.masked_fill_(outside, 0.0)  # q is 0 there: keep 0 * log q finite
        coef = z.add_(entropy.unsqueeze(-1)).mul_(g_entropy.unsqueeze(-1))
        if g_logp is not None:
            coef.add_(g_logp.unsqueeze(-1))
        q.mul_(coef).neg_()
    else:
        assert g_logp is not None
        q.mul_(-g_logp.unsqueeze(-1))
    if g_logp is not None:
        q.scatter_add_(-1, targets.unsqueeze(-1), g_logp.unsqueeze(-1))
    if plan.temperature is not None:
        q.div_(plan.temperature.unsqueeze(-1))
    if slope is not None:
        q.index_put_((plan.pen_rows, plan.pen_cols), q[plan.pen_rows, plan.pen_cols] * slope)
    return q
