"""The training sample: what crosses from serve to the learner.

The per-token fields are 1-D numpy arrays, always: int32 token ids, loss mask and versions,
float32 behaviour logprobs. The rollout builds them once (``Session.samples()``), the buffer
stores their bytes as they are, and the learner decodes straight into arrays for
``torch.from_numpy``. A list given to the constructor is turned into an array of that dtype there
(one place, so nothing downstream has a list variant); an array of the right dtype is kept as it
is, without a copy.

Invariants: all per-token fields have the same length; ``loss_mask[i] == 1`` exactly on tokens the
engine generated, and only those tokens carry a behaviour logprob and a policy version
(``versions[i] == -1`` and ``logprobs[i] == 0.0`` elsewhere). Token ids are the engine's own,
never re-tokenised text. Two samples are equal when every field is (arrays by value). ``behaviour``
(:mod:`agentrl.buffer.behaviour`) and ``routing`` (an MoE model's recorded experts), when present,
cover exactly the sample's tokens.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from agentrl.buffer.behaviour import Behaviour

_I32 = np.iinfo(np.int32)
_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)
ROUTING_DTYPES = {np.dtype(np.uint8): 255, np.dtype(np.int16): -1}  # routing dtype -> its "not recorded" id


def routing_array(tokens: int, layers: int, k: int, wide: bool) -> np.ndarray:
    """An all-"not recorded" routing array: uint8 ids (up to 255 experts) or int16 (``wide``)."""
    dtype = np.dtype(np.int16 if wide else np.uint8)
    return np.full((tokens, layers, k), ROUTING_DTYPES[dtype], dtype=dtype)


def int32_array(xs: Any, what: str) -> np.ndarray:
    """``xs`` as a 1-D int32 array; a value outside int32 is an OverflowError, never wrapped."""
    if isinstance(xs, np.ndarray):
        if xs.dtype == np.int32:
            return xs
        if xs.dtype.kind in "iu" and xs.size and (int(xs.min()) < _I32.min or int(xs.max()) > _I32.max):
            raise OverflowError(f"{what}: a value does not fit in int32")
        return xs.astype(np.int32)
    return np.asarray(xs, dtype=np.int32)  # a Python int out of range raises OverflowError here


def mask_array(xs: Any) -> np.ndarray:
    """The loss mask as int32. Bools and floats mean "generated or not" (nonzero becomes 1);
    integers keep their value (a weight of 2 stays 2)."""
    a = xs if isinstance(xs, np.ndarray) else np.asarray(xs)
    if a.dtype.kind in "bf":
        return (a != 0).astype(np.int32)
    return int32_array(a, "loss_mask")


def float32_array(xs: Any) -> np.ndarray:
    """Logprobs as float32, rounded to nearest; a finite value beyond float32 becomes +-inf."""
    if isinstance(xs, np.ndarray) and xs.dtype == np.float32:
        return xs
    with np.errstate(over="ignore"):  # the documented rounding, not an error
        return np.asarray(xs, dtype=np.float32)


_NAN_FIELDS = ("logprobs", "teacher_logprobs", "teacher_topk_logprobs", "token_rewards")  # NaN equals NaN


POLICY_KEY = "policy"  # a sample's (and a task's) info key naming its LoRA policy (serve.policies)


@dataclass(eq=False)
class Sample:
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
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
    behaviour: Behaviour | None = None  # how each generated token's distribution was formed (None: T=1, full vocabulary)
    routing: np.ndarray | None = None
    """MoE models: the experts the engine routed each token through, [tokens, moe layers, k] of
    uint8 (255: not recorded) or int16 (-1: not recorded); None for a dense model."""
    teacher_logprobs: np.ndarray | None = None
    """On-policy distillation: a teacher's log p(token_t | tokens_<t) of each token it scored
    (float32, NaN where it did not: the prompt, and a sample a teacher never saw is None).
    ``info["teacher"]`` says which teacher and version scored it (agentrl.scoring.teacher)."""
    teacher_topk_ids: np.ndarray | None = None
    """On-policy distillation with ``scoring.teacher.top_k``: the teacher's top-k token ids at each
    position it scored, [tokens, k] int32 in the teacher's order (-1 where it did not score)."""
    teacher_topk_logprobs: np.ndarray | None = None
    """Their logprobs under the teacher, [tokens, k] float32 (NaN where it did not score); both
    top-k fields are set together or not at all."""
    token_rewards: np.ndarray | None = None
    """Process rewards: a per-turn scorer's reward of each generated turn, on the turn's last token
    (float32, NaN elsewhere; agentrl.scoring, process scorers). None: outcome reward only."""

    def __post_init__(self) -> None:
        t, m, lp, v = self.token_ids, self.loss_mask, self.logprobs, self.versions
        # The common case (arrays of the right dtypes, from the rollout or the codec) costs a few
        # identity checks: a sample is built once per decoded record, 256 to a batch.
        if not (type(t) is np.ndarray and t.dtype is _INT32 and type(m) is np.ndarray and m.dtype is _INT32
                and type(lp) is np.ndarray and lp.dtype is _FLOAT32 and type(v) is np.ndarray and v.dtype is _INT32):
            self.token_ids = t = int32_array(t, "token_ids")
            self.loss_mask = m = mask_array(m)
            self.logprobs = lp = float32_array(lp)
            self.versions = v = int32_array(v, "versions")
        if not (t.ndim == 1 and t.shape == m.shape == lp.shape == v.shape):
            raise ValueError(
                f"sample {self.sample_id}: per-token fields must be 1-D of one length "
                f"(tokens {t.shape}, mask {m.shape}, logprobs {lp.shape}, versions {v.shape})"
            )
        r = self.routing
        if r is not None and not (type(r) is np.ndarray and r.ndim == 3 and r.shape[0] == t.shape[0]
                                  and r.dtype in ROUTING_DTYPES):
            raise ValueError(f"sample {self.sample_id}: routing must be a [tokens, layers, k] uint8 or int16 array "
                             f"over its {t.shape[0]} tokens, not {getattr(r, 'dtype', type(r))} "
                             f"{getattr(r, 'shape', '')}")
        for name in ("teacher_logprobs", "token_rewards"):
            if (a := getattr(self, name)) is not None:
                setattr(self, name, a := float32_array(a))
                if a.shape != t.shape:
                    raise ValueError(f"sample {self.sample_id}: {name.replace('_', ' ')} must be 1-D over its "
                                     f"{t.shape[0]} tokens, not {a.shape}")
        if self.teacher_topk_ids is not None or self.teacher_topk_logprobs is not None:
            self._check_topk()
        if self.behaviour is not None and self.behaviour.kept_counts.shape != t.shape:
            raise ValueError(f"sample {self.sample_id}: behaviour covers {self.behaviour.kept_counts.shape[0]} "
                             f"tokens of {t.shape[0]}")

    def _check_topk(self) -> None:
        ids, lp = self.teacher_topk_ids, self.teacher_topk_logprobs
        if ids is None or lp is None:
            raise ValueError(f"sample {self.sample_id}: the teacher's top-k ids and logprobs go together")
        self.teacher_topk_ids = ids = int32_array(ids, "teacher_topk_ids")
        self.teacher_topk_logprobs = lp = float32_array(lp)
        n = self.token_ids.shape[0]
        if not (ids.ndim == 2 and ids.shape[0] == n and lp.shape == ids.shape):
            raise ValueError(f"sample {self.sample_id}: the teacher's top-k ids and logprobs must both be "
                             f"[{n} tokens, k], not {ids.shape} and {lp.shape}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if a is None or b is None or not np.array_equal(a, b, equal_nan=f.name in _NAN_FIELDS):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced any generated token (-1 if none was generated)."""
        generated = self.versions[self.loss_mask != 0]
        return int(generated.min()) if generated.size else -1

    def staleness(self, learner_version: int) -> int:
        """Learner version minus the oldest version that produced this sample's tokens."""
        return learner_version - self.min_version if self.min_version >= 0 else 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the per-token arrays as lists, the behaviour as :meth:`Behaviour.to_dict`."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "behaviour"}
        for k in ("token_ids", "loss_mask", "logprobs", "versions"):
            d[k] = d[k].tolist()
        for k in ("routing", "teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs", "token_rewards"):
            if d[k] is not None:
                d[k] = d[k].tolist()
        d["behaviour"] = self.behaviour.to_dict() if self.behaviour is not None else None
        return d
