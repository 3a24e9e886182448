"""The micro-batch: one packed row of samples with every tensor the step reads, built once.

Role: the one layout between the samples and the learner's math. :meth:`MicroBatch.build` takes
the samples of one packed row (and the loss masks the batch chose for them) and returns what the
model's forward pass reads (the packed row, its position ids, the behaviour replay, the teacher's
top-k ids, the recorded MoE experts) and what the loss reads (the per-sample next-token layout of
the loss mask, behaviour logprobs, versions and each section's tensor), on one device.
:mod:`agentrl.learner.packing` runs the forward on it, :mod:`agentrl.learner.step` the loss.

Two views of the same tokens:
- the packed row, ``input_ids`` and ``position_ids`` ``[1, N]`` (``N`` the row's tokens; positions
  restart at 0 for every sample, so attention never crosses samples), on which the model runs and
  whose position ``j`` predicts token ``j + 1``;
- the per-sample layout ``[S, T-1]`` (``S`` samples, ``T`` the longest), where position ``t`` of
  sample ``i`` predicts its token ``t + 1``; :meth:`MicroBatch.unpack` maps a row's ``[N-1, ...]``
  onto it (zeros past each sample's end).

Invariants:
- Every per-sample tensor is shifted by one (position ``t``: token ``t + 1``) and padded with its
  field's fill past a sample's end: mask 0, behaviour 0, versions -1, a section's ``fill``
  (:class:`agentrl.buffer.sections.base.Section`; teacher logprobs NaN where no teacher scored).
- A section's tensor is present only when a sample of the row carries the section; its trailing
  shape is the widest any sample gave (a teacher's top-k of several widths pads with the fill).
- ``build`` is a pure function of the samples and masks: every rank builds the same micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from agentrl.buffer.sample import Sample
from agentrl.buffer.sections.base import sections
from agentrl.buffer.sections.routing import ROUTING_DTYPES
from agentrl.buffer.sections.teacher import TeacherLogprobs, TeacherTopK
from agentrl.learner.replay import RowReplay

TEACHER, TEACHER_TOPK = TeacherLogprobs.name, TeacherTopK.name  # what the built-in distillation terms read


@dataclass(frozen=True)
class MicroBatch:
    """One packed row of ``samples`` (see the module's docstring for the two layouts)."""

    samples: tuple[Sample, ...]
    input_ids: Tensor  # [1, N] long: the samples' tokens, concatenated
    position_ids: Tensor  # [1, N] long: restarting at 0 for every sample
    index: Tensor  # [S, T-1] long: where in the row's N-1 next-token positions each entry is
    valid: Tensor  # [S, T-1] bool: the entries that are a sample's (not padding)
    mask: Tensor  # [S, T-1] float32: the loss mask (the batch's, else the samples' own)
    behaviour: Tensor  # [S, T-1] float32: the engine's logprob of each sampled token
    versions: Tensor  # [S, T-1] long: the policy version that sampled each token (-1: none)
    replay: RowReplay  # the behaviour distribution each position was sampled from
    sections: dict[str, Tensor] = field(default_factory=dict)  # name -> [S, T-1, ...] (Section.fill)
    topk_ids: Tensor | None = None  # [N-1, k] long: the teacher's top-k at each row position (-1: none)
    routing: Tensor | None = None  # [1, N, moe layers, k] long: the recorded experts (-1: the learner routes)

    @classmethod
    def build(cls, samples: Sequence[Sample], masks: Sequence[np.ndarray] | None = None,
              device: torch.device | str = "cpu") -> MicroBatch:
        """The micro-batch of ``samples`` in this order; ``masks``: one loss mask per sample to use
        instead of its own (e.g. a completion another sample already trains masked out)."""
        if not samples:
            raise ValueError("a micro-batch needs at least one sample")
        lengths = [len(s.token_ids) for s in samples]
        width = max(lengths)
        index, valid = unpack_index(lengths)
        mask = _padded([s.loss_mask if masks is None else masks[i] for i, s in enumerate(samples)],
                       width, 0.0, np.float32)
        ids, pos = packed_inputs(samples)
        return cls(
            samples=tuple(samples), input_ids=ids.to(device), position_ids=pos.to(device),
            index=index.to(device), valid=valid.to(device), mask=mask.to(device),
            behaviour=_padded([s.logprobs for s in samples], width, 0.0, np.float32).to(device),
            versions=_padded([s.versions for s in samples], width, -1, np.int64).to(device),
            replay=RowReplay.build(samples, device),
            sections={k: v.to(device) for k, v in section_tensors(samples, width).items()},
            topk_ids=None if (t := topk_ids(samples)) is None else t.to(device),
            routing=None if (r := packed_routing(samples)) is None else r.to(device),
        )

    @property
    def lengths(self) -> list[int]:
        return [len(s.token_ids) for s in self.samples]

    @property
    def teacher(self) -> Tensor:
        """[S, T-1] the teacher's logprob of each sampled token, NaN where none scored."""
        got = self.sections.get(TEACHER)
        return got if got is not None else torch.full_like(self.behaviour, math.nan)

    def unpack(self, row: Tensor) -> Tensor:
        """A row's ``[N-1, ...]`` per-position values in the per-sample layout ``[S, T-1, ...]``
        (zeros past each sample's end)."""
        keep = self.valid.reshape(*self.valid.shape, *[1] * (row.dim() - 1))
        return torch.where(keep, row[self.index], torch.zeros((), dtype=row.dtype, device=row.device))


def _padded(arrays: Sequence[np.ndarray], width: int, fill: float, dtype: type) -> Tensor:
    """[S, width - 1]: each array right-padded with ``fill`` to ``width``, then shifted by one."""
    out = np.full((len(arrays), width), fill, dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return torch.from_numpy(out[:, 1:].copy())


def section_tensors(samples: Sequence[Sample], width: int) -> dict[str, Tensor]:
    """The tensor of each section that declares one (``Section.fill``) and that a sample of
    ``samples`` carries: [S, width - 1, ...], the section's ``fill`` where a sample has none and
    past its end, shifted like the token fields (position t: token t + 1). The trailing shape is
    the widest any sample gave; the dtype must be one."""
    out: dict[str, Tensor] = {}
    for name, section in sections().items():
        if section.fill is None:
            continue
        arrays = [section.tensor(s.sections[name]) if name in s.sections else None for s in samples]
        given = [a for a in arrays if a is not None]
        if not given:
            continue
        dtypes = {a.dtype for a in given}
        ranks = {a.ndim for a in given}
        if len(dtypes) > 1 or len(ranks) > 1:
            raise ValueError(f"section {name}: tensors of several dtypes or ranks in a micro-batch: "
                             f"{sorted(map(str, dtypes))}, {sorted(ranks)}")
        tail = tuple(max(a.shape[d] for a in given) for d in range(1, given[0].ndim))
        padded = np.full((len(samples), width, *tail), section.fill, dtype=given[0].dtype)
        for i, a in enumerate(arrays):
            if a is not None:
                padded[(i, slice(0, a.shape[0]), *(slice(0, n) for n in a.shape[1:]))] = a
        out[name] = torch.from_numpy(padded[:, 1:].copy())
    return out


def packed_inputs(samples: Sequence[Sample], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """One row: concatenated token ids [1, N] and per-sample restarting position ids [1, N]."""
    ids = torch.cat([torch.as_tensor(s.token_ids, dtype=torch.long) for s in samples])
    pos = torch.cat([torch.arange(len(s.token_ids), dtype=torch.long) for s in samples])
    return ids.unsqueeze(0).to(device), pos.unsqueeze(0).to(device)


def unpack_index(lengths: Sequence[int], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Gather index [S, W-1] into the row's N-1 next-token positions, and where it is valid."""
    width = max(lengths) - 1
    offsets = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0)
    n = torch.tensor(lengths, dtype=torch.long)
    t = torch.arange(max(width, 0), dtype=torch.long)
    valid = t.unsqueeze(0) < (n - 1).unsqueeze(1)
    index = torch.where(
        valid, offsets.unsqueeze(1) + t.unsqueeze(0), torch.zeros_like(valid, dtype=torch.long)
    )
    return index.to(device), valid.to(device)


def topk_width(samples: Sequence[Sample]) -> int:
    """The widest teacher top-k among ``samples`` (0: none has one)."""
    return max((s.teacher_topk_ids.shape[1] for s in samples if s.teacher_topk_ids is not None), default=0)


def topk_ids(samples: Sequence[Sample]) -> Tensor | None:
    """The teacher's top-k ids at each position of the packed row, [N-1, k] (-1 where none; packed
    position j predicts token j + 1, whose top-k these are), or None when no sample has one."""
    k = topk_width(samples)
    if not k:
        return None
    ids = torch.full((sum(len(s.token_ids) for s in samples), k), -1, dtype=torch.long)
    at = 0
    for s in samples:
        if s.teacher_topk_ids is not None:
            ids[at : at + len(s.token_ids), : s.teacher_topk_ids.shape[1]] = torch.from_numpy(
                s.teacher_topk_ids
            )
        at += len(s.token_ids)
    return ids[1:]


def packed_routing(samples: Sequence[Sample], device: torch.device | str = "cpu") -> Tensor | None:
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
