"""The behaviour distribution replayed on the learner's logits: penalties, temperature, kept sets.

Role: the engine drew each generated token from ``softmax(keep(penalise(z) / T))`` and, run with
processed logprobs, reported its logprob under exactly that distribution (the behaviour logprob).
:meth:`RowReplay.build` gathers what the samples of one packed row recorded
(:mod:`agentrl.buffer.behaviour`) into tensors; :func:`replayed_logprobs` applies it to the row's
next-token logits, so the learner's logprob of every sampled token is of the same distribution,
and importance ratios against the behaviour logprobs compare like with like.

The order and arithmetic are vLLM 0.32's sampler's (``v1/sample/sampler.py``), in fp32:

1. repetition penalty ``r``: the logit of a token that occurs in the call's prompt or in its
   output so far is multiplied by ``1/r`` when positive, by ``r`` otherwise; then frequency
   ``f`` and presence ``p``: minus ``f`` times its count in the call's output so far, minus ``p``
   if it occurred there. A call's prompt is the sample's tokens before the call (a continued call's
   prompt is exactly that prefix), so these are replayed exactly, per position;
2. division by the call's temperature;
3. the kept set: min-p, top-k and top-p are replayed from the ids the engine kept, never
   re-derived from the learner's logits (whose ranking may put the boundary elsewhere): a token
   outside the recorded set gets no probability, and the kept set's probabilities sum to 1;
4. log-softmax.

Invariants: a position without a behaviour (prompt tokens, a sample with no ``Behaviour``, a
call with neutral settings) gets the plain ``log_softmax`` of its logits, bit for bit; a greedy
call (temperature 0) replays at temperature 1, as vLLM reports its logprobs; the replay is per
sample and per position, so packing samples into one row does not change it; gradients flow
through every logit the replayed distribution uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from agentrl.buffer.behaviour import FREQUENCY, PRESENCE, REPETITION, T
from agentrl.buffer.sample import Sample

_GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: below it a call is greedy and its logprobs are at temperature 1


@dataclass
class RowReplay:
    """What turns a packed row's next-token logits ``[R, V]`` into the behaviour distribution.

    Position ``o + i - 1`` of the row predicts token ``i`` of the sample placed at offset ``o``.
    Fields are None when nothing of their kind applies to the row."""

    temperature: Tensor | None = None  # [R] float32, 1 where no call sampled
    kept_rows: Tensor | None = None  # [P] positions with a kept set
    kept_ids: Tensor | None = None  # [P, K] the kept ids, padded
    kept_valid: Tensor | None = None  # [P, K] which entries of kept_ids are real
    pen_rows: Tensor | None = None  # [M] (position, token) pairs a penalty touches
    pen_cols: Tensor | None = None  # [M]
    pen_count: Tensor | None = None  # [M] float32: the token's count in the call's output before the position
    pen_params: Tensor | None = None  # [M, 3] float32: presence, frequency, repetition

    @property
    def empty(self) -> bool:
        return self.temperature is None and self.kept_rows is None and self.pen_rows is None

    @classmethod
    def build(cls, samples: Sequence[Sample], device: torch.device | str = "cpu") -> RowReplay:
        """The replay of ``samples`` concatenated in this order into one row."""
        n_rows = sum(len(s.token_ids) for s in samples) - 1
        temp = np.ones(max(n_rows, 0), dtype=np.float32)
        kept_rows: list[np.ndarray] = []
        kept_sets: list[tuple[np.ndarray, np.ndarray]] = []  # (ids, counts) per sample
        pens: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        o = 0
        for s in samples:
            b = s.behaviour
            if b is not None:
                for c in range(b.calls):
                    start, length = int(b.starts[c]), int(b.lengths[c])
                    first = max(start, 1)  # token 0 is never predicted
                    if first >= start + length:
                        continue
                    t = float(b.params[c, T])
                    temp[o + first - 1 : o + start + length - 1] = (
                        b.params[c, T] if t >= _GREEDY_BELOW else 1.0
                    )
                    pen = b.params[c, [PRESENCE, FREQUENCY, REPETITION]]
                    if pen[0] != 0 or pen[1] != 0 or pen[2] != 1:
                        pens.append(_penalty_entries(s.token_ids, start, length, o, pen))
                idx = np.flatnonzero(b.kept_counts)
                idx = idx[idx >= 1]
                if idx.size:
                    kept_rows.append(o + idx - 1)
                    off = b.kept_offsets()
                    kept_sets.append((np.concatenate([b.kept_ids[off[i]:off[i + 1]] for i in idx]),
                                      b.kept_counts[idx]))
            o += len(s.token_ids)
        out = cls()
        if not np.all(temp == 1.0):
            out.temperature = torch.from_numpy(temp).to(device)
        if kept_rows:
            counts = np.concatenate([c for _, c in kept_sets])
            ids = np.concatenate([i for i, _ in kept_sets])
            width = int(counts.max())
            valid = np.arange(width)[None, :] < counts[:, None]
            padded = np.zeros((counts.shape[0], width), dtype=np.int64)
            padded[valid] = ids  # row-major fill: each row's ids in order
            out.kept_rows = torch.from_numpy(np.concatenate(kept_rows).astype(np.int64)).to(device)
            out.kept_ids = torch.from_numpy(padded).to(device)
            out.kept_valid = torch.from_numpy(valid).to(device)
        if pens:
            rows, cols, count, params = (np.concatenate(x) for x in zip(*pens, strict=True))
            out.pen_rows = torch.from_numpy(rows).to(device)
            out.pen_cols = torch.from_numpy(cols).to(device)
            out.pen_count = torch.from_numpy(count).to(device)
            out.pen_params = torch.from_numpy(params).to(device)
        return out

    def rows(self, start: int, stop: int) -> RowReplay:
        """The replay of positions ``[start, stop)`` alone, counted from ``start``: what a chunk of
        the row's positions needs (:mod:`agentrl.learner.head`)."""
        out = RowReplay()
        if self.temperature is not None:
            out.temperature = self.temperature[start:stop]
        if self.kept_rows is not None:
            assert self.kept_ids is not None and self.kept_valid is not None
            sel = (self.kept_rows >= start) & (self.kept_rows < stop)
            if bool(sel.any()):
                out.kept_rows, out.kept_ids, out.kept_valid = (
                    self.kept_rows[sel] - start,
                    self.kept_ids[sel],
                    self.kept_valid[sel],
                )
        if self.pen_rows is not None:
            assert self.pen_cols is not None and self.pen_count is not None and self.pen_params is not None
            sel = (self.pen_rows >= start) & (self.pen_rows < stop)
            if bool(sel.any()):
                out.pen_rows, out.pen_cols = self.pen_rows[sel] - start, self.pen_cols[sel]
                out.pen_count, out.pen_params = self.pen_count[sel], self.pen_params[sel]
        return out


def _penalty_entries(tokens: np.ndarray, start: int, length: int, offset: int,
                     pen: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The (position, token) pairs a call's penalties touch: the tokens seen in its prompt or in its
    output before each position (no other logit changes), with their output counts so far."""
    prompt, out = tokens[:start], tokens[start : start + length]
    seen_ids, inv = np.unique(np.concatenate([prompt, out]), return_inverse=True)
    onehot = np.zeros((length, seen_ids.shape[0]), dtype=np.int32)
    onehot[np.arange(length), inv[start:]] = 1
    before = np.cumsum(onehot, axis=0) - onehot  # counts in the output before each position
    in_prompt = np.zeros(seen_ids.shape[0], dtype=bool)
    in_prompt[inv[:start]] = True
    seen = in_prompt[None, :] | (before > 0)
    if start == 0:
        seen[0] = False  # token 0 is never predicted
    t, u = np.nonzero(seen)
    rows = (offset + start - 1 + t).astype(np.int64)
    return (rows, seen_ids[u].astype(np.int64), before[t, u].astype(np.float32),
            np.repeat(pen[None, :].astype(np.float32), t.shape[0], axis=0))


def behaviour_logits(logits: Tensor, plan: RowReplay) -> Tensor:
    """Steps 1-2 of the module doc (penalties, temperature) on ``logits`` [R, V] (fp32); no copy when neither
    applies."""
    z = logits
    if plan.pen_rows is not None:
        assert plan.pen_cols is not None and plan.pen_count is not None and plan.pen_params is not None
        zp, _ = penalised(z[plan.pen_rows, plan.pen_cols], plan)
        z = z.index_put((plan.pen_rows, plan.pen_cols), zp)
    if plan.temperature is not None:
        z = z / plan.temperature.unsqueeze(-1)
    return z


def penalised(zp: Tensor, plan: RowReplay) -> tuple[Tensor, Tensor]:
    """Step 1 of the module doc on the logits ``zp`` [M] of the plan's (position, token) pairs: the
    penalised logits, and their slope d(penalised) / d(zp) (the repetition factor; the rest is a shift)."""
    assert plan.pen_count is not None and plan.pen_params is not None
    r = plan.pen_params[:, 2]
    slope = torch.where(zp > 0, 1.0 / r, r)
    zp = zp * slope
    return zp - plan.pen_params[:, 1] * plan.pen_count - plan.pen_params[:, 0] * (plan.pen_count > 0), slope


def replayed_logprobs(logits: Tensor, targets: Tensor, plan: RowReplay) -> Tensor:
    """The behaviour logprob of each target [R] under the learner's logits [R, V] (fp32)."""
    check_vocab(logits.shape[-1], plan)
    z = behaviour_logits(logits, plan)
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if plan.kept_rows is None:
        return logp
    assert plan.kept_ids is not None and plan.kept_valid is not None
    # the kept set's normaliser, from its own logits only (no [P, V] mask)
    zk = z[plan.kept_rows.unsqueeze(-1), plan.kept_ids].masked_fill(~plan.kept_valid, float("-inf"))
    zt = z[plan.kept_rows, targets[plan.kept_rows]]
    return logp.index_put((plan.kept_rows,), zt - torch.logsumexp(zk, dim=-1))


def replayed_log_softmax(logits: Tensor, plan: RowReplay) -> Tensor:
    """The whole replayed distribution [R, V] (-inf outside each kept set): for checks and
    measurements; :func:`replayed_logprobs` computes its targets' entries without the [R, V] mask."""
    check_vocab(logits.shape[-1], plan)
    z = behaviour_logits(logits, plan)
    if plan.kept_rows is not None:
        assert plan.kept_ids is not None and plan.kept_valid is not None
        outside = torch.ones((plan.kept_rows.shape[0], z.shape[-1]), dtype=torch.bool, device=z.device)
        outside[torch.nonzero(plan.kept_valid, as_tuple=True)[0], plan.kept_ids[plan.kept_valid]] = False
        z = z.index_put((plan.kept_rows,), z[plan.kept_rows].masked_fill(outside, float("-inf")))
    return torch.log_softmax(z, dim=-1)


def check_vocab(vocab: int, plan: RowReplay) -> None:
    """Refuse a plan that names a token id outside a vocabulary of ``vocab`` logits."""
    for ids in (plan.kept_ids, plan.pen_cols):
        if ids is not None and ids.numel() and int(ids.max()) >= vocab:
            raise ValueError(f"a recorded token id {int(ids.max())} is outside the model's {vocab} logits")
