"""The training sample: what crosses from serve to the learner.

The per-token fields are Python lists or 1-D numpy arrays (int32 token ids, mask and versions,
float32 logprobs). The rollout builds arrays once (``Session.samples(as_arrays=True)``), the buffer
stores their bytes as they are, and the learner decodes straight into arrays
(``decode_sample(..., as_arrays=True)``) for ``torch.from_numpy``; lists stay accepted everywhere.
Compare array samples field by field (``np.array_equal``), not with ``==``.

Invariants: all per-token fields have the same length; ``loss_mask[i] == 1`` exactly on tokens the
engine generated, and only those tokens carry a behaviour logprob and a policy version
(``versions[i] == -1`` and ``logprobs[i] == 0.0`` elsewhere). Token ids are the engine's own,
never re-tokenised text.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class Sample:
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    episode_id: str
    group_id: str
    env: str
    reward: float
    sample_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    truncated: bool = False
    error: str | None = None  # a failed episode's error, "<Class>: message"
    error_kind: str | None = None  # which boundary failed (agentrl.errors.ErrorKind), None when none did
    info: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError(
                f"sample {self.sample_id}: per-token lists differ in length "
                f"(tokens {n}, mask {len(self.loss_mask)}, logprobs {len(self.logprobs)}, "
                f"versions {len(self.versions)})"
            )

    def _generated_versions(self) -> np.ndarray | list[int]:
        if isinstance(self.versions, np.ndarray) or isinstance(self.loss_mask, np.ndarray):
            return np.asarray(self.versions)[np.asarray(self.loss_mask) != 0]
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced any generated token (-1 if none was generated)."""
        generated = self._generated_versions()
        if isinstance(generated, np.ndarray):
            return int(generated.min()) if generated.size else -1
        return min(generated) if generated else -1

    def staleness(self, learner_version: int) -> int:
        """Learner version minus the oldest version that produced this sample's tokens."""
        return learner_version - self.min_version if self.min_version >= 0 else 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
