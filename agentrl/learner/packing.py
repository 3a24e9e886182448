"""Sequence packing: samples concatenated into rows of at most ``max_tokens`` tokens.

Role: turn a batch of variable-length samples into few dense rows so no compute is spent on
padding (:func:`pack`), and run the model on one row, a
:class:`~agentrl.learner.microbatch.MicroBatch`, returning its logprobs, entropies and teacher
top-k in the per-sample layout (:func:`packed_forward`). ``pad_batch`` is the right-padded view of
the same micro-batch, the reference the packed path is checked against.

Invariants:
- Position ids restart at 0 for every sample and the model is called with ``attention_mask=None``,
  so attention reads the sample boundaries from the position ids (the learner's own sdpa runs each
  sample's span alone, :mod:`agentrl.learner.attention`; transformers builds a block-diagonal mask
  for eager, varlen kernels for flash attention): attention never crosses samples.
- ``packed_logprobs`` returns exactly the [S, T-1] layout of ``pad_batch`` + ``token_logprobs``
  (position t predicts token t+1, zeros past each sample's end), so every loss, aggregation and
  sequence-level correction sees the same tensors as without packing.
- ``packed_logprobs`` replays each sample's behaviour distribution (its calls' penalties and
  temperatures and its tokens' kept sets, :mod:`agentrl.learner.replay`) per position, so its
  logprobs are of the distribution the engine sampled and equal to each sample's own replay
  whatever it is packed with; a sample without a behaviour, or with neutral sampling, gets plain
  ``log_softmax`` (what ``token_logprobs`` computes; to fp32 rounding, since the head runs in chunks).
- ``routing_replayed`` routes each packed token of an MoE model through the experts its sample
  recorded (:mod:`agentrl.learner.routing`); tokens without a record, and samples without a
  routing, are routed by the learner. Routing is per token, so packing does not change it.
- Packing is a pure function of the token counts: every rank computes the same rows.
- Logprobs are a log-softmax over fp32 logits (the learner's LM head is fp32, also under bf16 FSDP,
  ``dist.load_model``), computed a chunk of positions at a time (:mod:`agentrl.learner.head`): the
  [N, V] logits of a whole row never exist at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from agentrl.buffer.sample import Sample
from agentrl.learner.head import CHUNK_TOKENS, row_terms
from agentrl.learner.microbatch import (  # noqa: F401 (packed_inputs, unpack_index: their home before)
    TEACHER_TOPK,
    MicroBatch,
    packed_inputs,
    packed_routing,
    unpack_index,
)
from agentrl.learner.replay import RowReplay
from agentrl.learner.routing import ReplayStats, replay_routing


def token_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """log pi(token_t | tokens_<t) for t >= 1 on a right-padded batch, shape [B, T-1] (fp32)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def pad_batch(
    samples: Sequence[Sample], pad_id: int, masks: Sequence[np.ndarray] | None = None
) -> dict[str, Tensor]:
    """The right-padded view of ``samples``: ``input_ids`` and ``attention_mask`` [B, T] (for
    :func:`token_logprobs`, the unpacked reference) and the micro-batch's per-sample tensors [B, T-1]
    (:class:`~agentrl.learner.microbatch.MicroBatch`): ``mask``, ``behaviour``, ``versions``,
    ``teacher`` (NaN where no teacher scored), ``teacher_topk`` when a sample has one, and each
    section's tensor under ``SECTION_KEY + name``.

    ``masks``: loss masks to use instead of the samples' own (one per sample, same lengths), e.g.
    with a completion that another sample already trains masked out (:mod:`agentrl.learner.batch`).
    """
    mb = MicroBatch.build(samples, masks)
    width = max(mb.lengths)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s.token_ids)] = torch.as_tensor(s.token_ids, dtype=torch.long)
        attn[i, : len(s.token_ids)] = 1
    out = {"input_ids": ids, "attention_mask": attn, "mask": mb.mask, "behaviour": mb.behaviour,
           "versions": mb.versions, "teacher": mb.teacher}
    if TEACHER_TOPK in mb.sections:
        out["teacher_topk"] = mb.sections[TEACHER_TOPK]
    out.update({SECTION_KEY + name: tensor for name, tensor in mb.sections.items()})
    return out


SECTION_KEY = "section:"  # pad_batch's key of a section's tensor: SECTION_KEY + its name


def pack(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bins of sample indexes whose lengths sum to at most ``max_tokens``.

    A sample longer than ``max_tokens`` gets a row of its own (it cannot be split: its tokens
    attend to each other). Rows come out longest-first; members keep their index order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_tokens - n)
    return [sorted(r) for r in rows]


Rows = MicroBatch | Sequence[Sample]  # a built micro-batch, or the samples of one (built on the spot)


def micro_batch(rows: Rows, device: torch.device | str = "cpu") -> MicroBatch:
    """``rows`` as a :class:`MicroBatch` (samples are built into one with their own loss masks)."""
    return rows if isinstance(rows, MicroBatch) else MicroBatch.build(rows, device=device)


def packed_logprobs(model: torch.nn.Module, rows: Rows, device: torch.device | str = "cpu",
                    replay: bool = True, chunk_tokens: int = CHUNK_TOKENS) -> Tensor:
    """Next-token logprobs of one packed row: :func:`packed_forward`'s ``logp``."""
    return packed_forward(model, rows, device, replay, chunk_tokens=chunk_tokens).logp


@dataclass
class Forward:
    """One packed forward pass: ``logp`` [S, T-1], each sampled token's logprob; ``entropy`` [S, T-1],
    the entropy of the distribution it was drawn from; ``topk`` [S, T-1, k], the plain log-softmax of
    the teacher's top-k tokens at each position (0 where the sample has none), when asked for."""

    logp: Tensor
    entropy: Tensor
    topk: Tensor | None = None


def packed_forward(model: torch.nn.Module, rows: Rows, device: torch.device | str = "cpu",
                   replay: bool = True, topk: bool = False, chunk_tokens: int = CHUNK_TOKENS) -> Forward:
    """Next-token logprobs of one packed row, unpacked to [S, T-1] (fp32), under each sample's
    behaviour distribution (``replay=False``: plain log-softmax, as the learner computed before
    samples recorded their sampling). The LM head runs ``chunk_tokens`` positions at a time
    (:mod:`agentrl.learner.head`; 0: the whole row's logits at once).

    For samples without a behaviour, equal (to float rounding) to ``token_logprobs(model,
    **pad_batch(samples))`` on the valid positions; zero past each sample's end.
    """
    mb = micro_batch(rows, device)
    terms = row_terms(model, mb.input_ids, mb.position_ids, mb.replay if replay else RowReplay(),
                      mb.topk_ids if topk else None, chunk_tokens)
    return Forward(mb.unpack(terms.logp), mb.unpack(terms.entropy),
                   None if terms.topk is None else mb.unpack(terms.topk))


@contextlib.contextmanager
def routing_replayed(model: torch.nn.Module, rows: Rows, device: torch.device | str = "cpu",
                     stats: ReplayStats | None = None, follow: bool = True) -> Iterator[None]:
    """Within the block, a forward pass over the packed row (and its backward, which recomputes it
    under activation checkpointing) routes each token through its recorded experts; nothing changes
    for samples without a routing. ``follow=False`` only counts, in ``stats``, where the learner's own
    routing differs from the record."""
    experts = rows.routing if isinstance(rows, MicroBatch) else packed_routing(rows, device)
    if experts is None:
        yield
        return
    with replay_routing(model, experts, stats, follow=follow):
        yield
