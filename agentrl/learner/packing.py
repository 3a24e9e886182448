"""Sequence packing: samples concatenated into rows of at most ``max_tokens`` tokens.

Role: turn a batch of variable-length samples into few dense rows so no compute is spent on
padding, and turn the row's logprobs back into one right-padded row per sample.

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
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from agentrl.buffer.sections.base import sections
from agentrl.buffer.sections.routing import ROUTING_DTYPES
from agentrl.learner.head import CHUNK_TOKENS, row_terms
from agentrl.learner.replay import RowReplay
from agentrl.learner.routing import ReplayStats, replay_routing


def token_logprobs(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """log pi(token_t | tokens_<t) for t >= 1 on a right-padded batch, shape [B, T-1] (fp32)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def pad_batch(samples: Sequence[Any], pad_id: int, masks: Sequence[Any] | None = None) -> dict[str, Tensor]:
    """Right-padded tensors; per-token fields shifted to align with next-token logprobs.

    ``masks``: loss masks to use instead of the samples' own (one per sample, same lengths), e.g.
    with a completion that another sample already trains masked out (:mod:`agentrl.learner.batch`).
    """
    width = max(len(s.token_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    behaviour = torch.zeros((b, width), dtype=torch.float32)
    versions = torch.full((b, width), -1, dtype=torch.long)
    teacher = torch.full((b, width), math.nan, dtype=torch.float32)  # NaN: no teacher scored the token
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = torch.as_tensor(s.token_ids, dtype=torch.long)
        attn[i, :n] = 1
        mask[i, :n] = torch.as_tensor(s.loss_mask if masks is None else masks[i], dtype=torch.float32)
        behaviour[i, :n] = torch.as_tensor(s.logprobs, dtype=torch.float32)
        versions[i, :n] = torch.as_tensor(s.versions, dtype=torch.long)
        if getattr(s, "teacher_logprobs", None) is not None:
            teacher[i, :n] = torch.as_tensor(s.teacher_logprobs, dtype=torch.float32)
    # position t of the [B, T-1] logprob tensor predicts token t+1
    out = {"input_ids": ids, "attention_mask": attn, "mask": mask[:, 1:], "behaviour": behaviour[:, 1:],
           "versions": versions[:, 1:], "teacher": teacher[:, 1:]}
    k = topk_width(samples)
    if k:  # the teacher's top-k logprobs, [B, T-1, k] (NaN where it did not score)
        top = torch.full((b, width, k), math.nan, dtype=torch.float32)
        for i, s in enumerate(samples):
            if s.teacher_topk_logprobs is not None:
                top[i, : len(s.token_ids), : s.teacher_topk_logprobs.shape[1]] = torch.from_numpy(s.teacher_topk_logprobs)
        out["teacher_topk"] = top[:, 1:]
    out.update(section_tensors(samples, width))
    return out


SECTION_KEY = "section:"  # pad_batch's key of a section's tensor: SECTION_KEY + its name


def section_tensors(samples: Sequence[Any], width: int) -> dict[str, Tensor]:
    """The micro-batch tensor of each section that declares one (``Section.fill``) and that a
    sample of ``samples`` carries: [B, width - 1, ...], the section's ``fill`` where a sample has
    none and past its end, shifted like ``pad_batch``'s fields (position t: token t + 1)."""
    out: dict[str, Tensor] = {}
    for name, section in sections().items():
        if section.fill is None:
            continue
        arrays = [section.tensor(s.sections[name]) if name in getattr(s, "sections", {}) else None
                  for s in samples]
        shapes = {(a.shape[1:], a.dtype) for a in arrays if a is not None}
        if not shapes:
            continue
        if len(shapes) > 1:
            raise ValueError(f"section {name}: tensors of several shapes or dtypes in a micro-batch: "
                             f"{shapes}")
        ((tail, dtype),) = shapes
        padded = np.full((len(samples), width, *tail), section.fill, dtype=dtype)
        for i, a in enumerate(arrays):
            if a is not None:
                padded[i, : a.shape[0]] = a
        out[SECTION_KEY + name] = torch.from_numpy(padded)[:, 1:]
    return out


def topk_width(samples: Sequence[Any]) -> int:
    """The widest teacher top-k among ``samples`` (0: none has one)."""
    return max((s.teacher_topk_ids.shape[1] for s in samples if getattr(s, "teacher_topk_ids", None) is not None),
               default=0)


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


def packed_inputs(samples: Sequence[Any], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """One row: concatenated token ids [1, N] and per-sample restarting position ids [1, N]."""
    ids = torch.cat([torch.as_tensor(s.token_ids, dtype=torch.long) for s in samples])
    pos = torch.cat([torch.arange(len(s.token_ids), dtype=torch.long) for s in samples])
    return ids.unsqueeze(0).to(device), pos.unsqueeze(0).to(device)


def unpack_index(lengths: Sequence[int], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Gather index [S, W-1] into the row's N-1 next-token logprobs, and where it is valid."""
    width = max(lengths) - 1
    offsets = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0)
    n = torch.tensor(lengths, dtype=torch.long)
    t = torch.arange(max(width, 0), dtype=torch.long)
    valid = t.unsqueeze(0) < (n - 1).unsqueeze(1)
    index = torch.where(valid, offsets.unsqueeze(1) + t.unsqueeze(0), torch.zeros_like(valid, dtype=torch.long))
    return index.to(device), valid.to(device)


def packed_logprobs(model: Any, samples: Sequence[Any], device: torch.device | str = "cpu",
                    replay: bool = True, chunk_tokens: int = CHUNK_TOKENS) -> Tensor:
    """Next-token logprobs of ``samples`` packed into one row: :func:`packed_forward`'s ``logp``."""
    return packed_forward(model, samples, device, replay, chunk_tokens=chunk_tokens).logp


@dataclass
class Forward:
    """One packed forward pass: ``logp`` [S, T-1], each sampled token's logprob; ``entropy`` [S, T-1],
    the entropy of the distribution it was drawn from; ``topk`` [S, T-1, k], the plain log-softmax of
    the teacher's top-k tokens at each position (0 where the sample has none), when asked for."""

    logp: Tensor
    entropy: Tensor
    topk: Tensor | None = None


def packed_forward(model: Any, samples: Sequence[Any], device: torch.device | str = "cpu",
                   replay: bool = True, topk: bool = False, chunk_tokens: int = CHUNK_TOKENS) -> Forward:
    """Next-token logprobs of ``samples`` packed into one row, unpacked to [S, T-1] (fp32), under
    each sample's behaviour distribution (``replay=False``: plain log-softmax, as the learner
    computed before samples recorded their sampling). The LM head runs ``chunk_tokens`` positions
    at a time (:mod:`agentrl.learner.head`; 0: the whole row's logits at once).

    For samples without a behaviour, equal (to float rounding) to ``token_logprobs(model,
    **pad_batch(samples))`` on the valid positions; zero past each sample's end.
    """
    ids, pos = packed_inputs(samples, device)
    plan = RowReplay.build(samples, device) if replay else RowReplay()
    terms = row_terms(model, ids, pos, plan, _topk_ids(samples, device) if topk else None, chunk_tokens)
    index, valid = unpack_index([len(s.token_ids) for s in samples], device)

    def unpack(row: Tensor) -> Tensor:  # [N-1, ...] -> [S, T-1, ...]; boundary entries unused
        mask = valid.reshape(*valid.shape, *[1] * (row.dim() - 1))
        return torch.where(mask, row[index], torch.zeros((), dtype=row.dtype, device=row.device))

    return Forward(unpack(terms.logp), unpack(terms.entropy), None if terms.topk is None else unpack(terms.topk))


def _topk_ids(samples: Sequence[Any], device: torch.device | str) -> Tensor:
    """The teacher's top-k ids at each position of the packed row, [N-1, k] (-1 where none): packed
    position j predicts token j + 1, whose top-k these are."""
    ids = torch.full((sum(len(s.token_ids) for s in samples), topk_width(samples)), -1, dtype=torch.long)
    at = 0
    for s in samples:
        if s.teacher_topk_ids is not None:
            ids[at : at + len(s.token_ids), : s.teacher_topk_ids.shape[1]] = torch.from_numpy(s.teacher_topk_ids)
        at += len(s.token_ids)
    return ids[1:].to(device)


def packed_routing(samples: Sequence[Any], device: torch.device | str = "cpu") -> Tensor | None:
    """The recorded experts of ``samples`` packed into one row, [1, N, moe layers, k] (long; -1 where
    the learner routes the token itself), or None when no sample has a routing."""
    shapes = {s.routing.shape[1:] for s in samples if s.routing is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"samples recorded routings of different shapes (layers, k): {sorted(shapes)}")
    (shape,) = shapes
    row = np.full((sum(len(s.token_ids) for s in samples), *shape), -1, dtype=np.int64)
    at = 0
    for s in samples:
        n = len(s.token_ids)
        if s.routing is not None:
            r = s.routing.astype(np.int64)
            r[s.routing == ROUTING_DTYPES[s.routing.dtype]] = -1  # not recorded
            row[at : at + n] = r
        at += n
    return torch.from_numpy(row).unsqueeze(0).to(device)


@contextlib.contextmanager
def routing_replayed(model: Any, samples: Sequence[Any], device: torch.device | str = "cpu",
                     stats: ReplayStats | None = None) -> Iterator[None]:
    """Within the block, a forward pass over ``samples`` packed into one row (and its backward,
    which recomputes it under activation checkpointing) routes each token through its recorded
    experts; nothing changes for samples without a routing."""
    experts = packed_routing(samples, device)
    if experts is None:
        yield
        return
    with replay_routing(model, experts, stats):
        yield
