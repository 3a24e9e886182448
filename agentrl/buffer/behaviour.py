"""How the behaviour distribution of a sample's generated tokens was formed, so the learner can replay it.

The engine samples each token from its logits after penalties, temperature, min-p and top-k/top-p,
and (run with processed logprobs) reports the logprob under exactly that distribution. A
:class:`Behaviour` records what the learner needs to compute the same distribution on its own
logits (:mod:`agentrl.learner.replay`):

- per model call (``starts``, ``lengths``, ``params``): the sampling settings the engine applied
  to the call, columns :data:`PARAMS`, over the sample tokens ``[start, start + length)`` that
  the call generated;
- per token (``kept_counts``, ``kept_ids``): where the vocabulary was truncated (top-k, top-p,
  min-p), the ids the token was drawn from, in CSR form: token ``i`` kept the
  ``kept_counts[i]`` ids that follow those of the tokens before it in ``kept_ids``. A count of 0
  means the token was drawn from the whole vocabulary (a kept set is never empty: it holds the
  sampled token).

Invariants (checked on construction, in time independent of the kept sets' size): ``starts``,
``lengths``, ``kept_counts`` int32, ``params`` float32 of shape ``[calls, len(PARAMS)]``,
``kept_ids`` int32; call spans lie inside the sample, ascending and disjoint; ``kept_counts`` is
one entry per sample token, non-negative, summing to ``len(kept_ids)``, and zero outside the call
spans. :meth:`from_calls` (the router's builder) also checks each sampled token is in its kept set.
A sample without a ``Behaviour`` (records written before it existed, hand-built samples) is
treated as sampled at temperature 1 from the whole vocabulary, the old assumption.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PARAMS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                           "repetition_penalty")
NEUTRAL: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
T, TOP_P, TOP_K, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(len(PARAMS))
_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)


@dataclass(eq=False)
class Behaviour:
    starts: np.ndarray  # int32 [C]: first sample token each call generated
    lengths: np.ndarray  # int32 [C]: tokens each call generated
    params: np.ndarray  # float32 [C, len(PARAMS)]: the sampling settings the engine applied to each call
    kept_counts: np.ndarray  # int32 [n]: size of each token's kept set (0: the whole vocabulary)
    kept_ids: np.ndarray  # int32 [sum(kept_counts)]: the kept sets, token after token

    def __post_init__(self) -> None:
        self.starts = np.ascontiguousarray(self.starts, dtype=np.int32)
        self.lengths = np.ascontiguousarray(self.lengths, dtype=np.int32)
        self.params = np.ascontiguousarray(self.params, dtype=np.float32).reshape(-1, len(PARAMS))
        self.kept_counts = np.ascontiguousarray(self.kept_counts, dtype=np.int32)
        self.kept_ids = np.ascontiguousarray(self.kept_ids, dtype=np.int32)
        c, n = self.starts.shape[0], self.kept_counts.shape[0]
        if (
            self.starts.ndim != 1
            or self.lengths.shape != (c,)
            or self.params.shape[0] != c
            or self.kept_ids.ndim != 1
        ):
            raise ValueError(f"behaviour: {c} call starts, lengths "
                             f"{self.lengths.shape}, params {self.params.shape}")
        ends = self.starts.astype(np.int64) + self.lengths
        if c and (int(self.starts.min()) < 0 or int(self.lengths.min()) < 0 or int(ends.max()) > n
                  or bool(np.any(self.starts[1:] < ends[:-1]))):
            raise ValueError("behaviour: call spans "
                             f"{list(zip(self.starts.tolist(), ends.tolist(), strict=True))} "
                             f"do not lie ascending and disjoint inside {n} tokens")
        if n and int(self.kept_counts.min()) < 0:
            raise ValueError("behaviour: a kept count is negative")
        cum = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.kept_counts, out=cum[1:])
        if int(cum[-1]) != self.kept_ids.shape[0]:
            raise ValueError(f"behaviour: kept counts add up to {int(cum[-1])}, "
                             f"not the {self.kept_ids.shape[0]} kept ids")
        if int((cum[ends] - cum[self.starts]).sum()) != int(cum[-1]):
            raise ValueError("behaviour: a token outside every call span has a kept set")

    @classmethod
    def from_calls(
        cls,
        n: int,
        calls: Sequence[tuple[int, int, Mapping[str, float], Sequence[Sequence[int]] | None]],
        token_ids: np.ndarray,
    ) -> Behaviour:
        """From ``(start, length, settings, kept sets or None)`` per call of a sample of ``n`` tokens
        (settings missing a key take its neutral value). Raises ValueError when a sampled token is
        not in its own kept set: the record would give the token no probability."""
        calls = sorted(calls, key=lambda c: c[0])
        counts = np.zeros(n, dtype=np.int32)
        ids: list[np.ndarray] = []
        for start, length, _, kept in calls:
            if kept is None:
                continue
            if len(kept) != length:
                raise ValueError(f"behaviour: {len(kept)} kept sets for a call of {length} tokens")
            for i, ks in enumerate(kept):
                if ks:
                    if int(token_ids[start + i]) not in ks:
                        raise ValueError(f"behaviour: token {int(token_ids[start + i])} "
                                         f"at {start + i} is not in its kept set")
                    counts[start + i] = len(ks)
                    ids.append(np.asarray(ks, dtype=np.int32))
        params = np.array([[float(s.get(p, NEUTRAL[p])) for p in PARAMS] for _, _, s, _ in calls],
                          dtype=np.float32).reshape(-1, len(PARAMS))
        return cls(
            np.array([c[0] for c in calls], dtype=np.int32),
            np.array([c[1] for c in calls], dtype=np.int32),
            params,
            counts,
            np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Behaviour):
            return NotImplemented
        return all(np.array_equal(getattr(self, k), getattr(other, k))
                   for k in ("starts", "lengths", "params", "kept_counts", "kept_ids"))

    __hash__ = None  # type: ignore[assignment]

    @property
    def calls(self) -> int:
        return int(self.starts.shape[0])

    def settings(self, call: int) -> dict[str, float]:
        """Call ``call``'s sampling settings by name."""
        return dict(zip(PARAMS, self.params[call].tolist(), strict=True))

    def kept_offsets(self) -> np.ndarray:
        """int64 [n + 1]: token ``i``'s kept set is ``kept_ids[offsets[i]:offsets[i + 1]]``."""
        out = np.zeros(self.kept_counts.shape[0] + 1, dtype=np.int64)
        np.cumsum(self.kept_counts, out=out[1:])
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: calls by name, kept sets as lists per truncated token index."""
        off = self.kept_offsets()
        return {"calls": [{"start": int(s), "length": int(n), **self.settings(i)}
                          for i, (s, n) in enumerate(zip(self.starts, self.lengths, strict=True))],
                "kept": {str(i): self.kept_ids[off[i]:off[i + 1]].tolist()
                         for i in np.flatnonzero(self.kept_counts).tolist()}}
