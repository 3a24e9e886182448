"""The training sample: what crosses from serve to the learner.

A sample is a small core every feature shares (token ids, loss mask, behaviour logprobs and
policy versions per token; episode, group and policy identity; reward, flags, timings, error kind)
plus named sections, each a feature's own data declared beside the feature
(:mod:`agentrl.buffer.sections`: the behaviour, MoE routing, the teacher's logprobs and top-k,
process rewards). A section's fields read and set as attributes (``sample.routing``, None while
unset) and are keyword arguments of the constructor and of ``dataclasses.replace``; they are
stored in ``sample.sections`` (section name -> its fields that are set), and validated by their
section.

The per-token core fields are 1-D numpy arrays, always: int32 token ids, loss mask and versions,
float32 behaviour logprobs. The rollout builds them once (``Session.samples()``), the buffer
stores their bytes as they are, and the learner decodes straight into arrays for
``torch.from_numpy``. A list given to the constructor is turned into an array of that dtype there
(one place, so nothing downstream has a list variant); an array of the right dtype is kept as it
is, without a copy.

Invariants: all per-token core fields have the same length; ``loss_mask[i] == 1`` exactly on
tokens the engine generated, and only those tokens carry a behaviour logprob and a policy version
(``versions[i] == -1`` and ``logprobs[i] == 0.0`` elsewhere). Token ids are the engine's own,
never re-tokenised text. Every section passes its own check on construction (assignment later is
not checked). Two samples are equal when every core field and every section is (arrays by value).
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from agentrl.buffer import sections as _builtin  # noqa: F401  (registers the built-in sections)
from agentrl.buffer.arrays import float32_array, int32_array, mask_array
from agentrl.buffer.sections.base import holder
from agentrl.buffer.sections.base import sections as registered
from agentrl.buffer.sections.routing import ROUTING_DTYPES, routing_array

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = ["POLICY_KEY", "ROUTING_DTYPES", "Sample", "routing_array"]

_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)

POLICY_KEY = "policy"  # a sample's (and a task's) info key naming its LoRA policy (serve.policies)


@dataclass(eq=False, init=False)
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
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Section name -> the values of its fields that are set (agentrl.buffer.sections)."""

    def __init__(self, token_ids: ArrayLike, loss_mask: ArrayLike, logprobs: ArrayLike, versions: ArrayLike,
                 episode_id: str, group_id: str, env: str, reward: float, sample_id: str | None = None,
                 truncated: bool = False, error: str | None = None, error_kind: str | None = None,
                 info: dict[str, Any] | None = None, timings: dict[str, float] | None = None,
                 sections: dict[str, dict[str, Any]] | None = None, **section_fields: Any) -> None:
        """``section_fields``: values of registered sections' fields by field name (None: unset),
        over what ``sections`` holds."""
        sample_id = uuid.uuid4().hex if sample_id is None else sample_id
        t, m, lp, v = token_ids, loss_mask, logprobs, versions
        # The common case (arrays of the right dtypes, from the rollout or the codec) costs a few
        # identity checks: a sample is built once per decoded record, 256 to a batch.
        if not (type(t) is np.ndarray and t.dtype is _INT32 and type(m) is np.ndarray and m.dtype is _INT32
                and type(lp) is np.ndarray and lp.dtype is _FLOAT32
                and type(v) is np.ndarray and v.dtype is _INT32):
            t, m = int32_array(t, "token_ids"), mask_array(m)
            lp, v = float32_array(lp), int32_array(v, "versions")
        if not (t.ndim == 1 and t.shape == m.shape == lp.shape == v.shape):
            raise ValueError(
                f"sample {sample_id}: per-token fields must be 1-D of one length "
                f"(tokens {t.shape}, mask {m.shape}, logprobs {lp.shape}, versions {v.shape})"
            )
        own = {name: dict(values) for name, values in sections.items()} if sections else {}
        for name, value in section_fields.items():
            section = holder(name)
            if section is None:
                raise TypeError(f"Sample() got an unexpected keyword argument {name!r} (the section fields "
                                f"registered: {sorted(f for s in registered().values() for f in s.fields)})")
            if value is None:
                own.get(section.name, {}).pop(name, None)
            else:
                own.setdefault(section.name, {})[name] = value
        for name, values in list(own.items()):
            if not values:
                del own[name]
                continue
            section = registered().get(name)
            if section is None:
                raise ValueError(f"sample {sample_id}: no section {name!r} is registered")
            try:
                own[name] = section.check(values, t.shape[0])
            except ValueError as e:
                raise ValueError(f"sample {sample_id}: {e}") from e
        self.__dict__.update(token_ids=t, loss_mask=m, logprobs=lp, versions=v, episode_id=episode_id,
                             group_id=group_id, env=env, reward=reward, sample_id=sample_id,
                             truncated=truncated, error=error, error_kind=error_kind,
                             info={} if info is None else info, timings={} if timings is None else timings,
                             sections=own)

    def __getattr__(self, name: str) -> Any:
        """A section's field (called only for names that are not core attributes)."""
        section = holder(name)
        if section is None:
            raise AttributeError(f"'Sample' object has no attribute {name!r}")
        values = self.__dict__.get("sections", {}).get(section.name)
        return None if values is None else values.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        section = holder(name)
        if section is None:
            object.__setattr__(self, name, value)
            return
        values = self.sections.setdefault(section.name, {})
        if value is not None:
            values[name] = value
            return
        values.pop(name, None)
        if not values:
            del self.sections[section.name]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "sections":
                if a.keys() != b.keys() or not all(registered()[k].equal(a[k], b[k]) for k in a):
                    return False
            elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if a is None or b is None or not np.array_equal(a, b, equal_nan=f.name == "logprobs"):
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
        """JSON-ready: the per-token arrays as lists, and every registered section's fields (None
        where unset) in its own JSON form (the behaviour as :meth:`Behaviour.to_dict`)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "sections"}
        for k in ("token_ids", "loss_mask", "logprobs", "versions"):
            d[k] = d[k].tolist()
        for section in registered().values():
            values = self.sections.get(section.name, {})
            for name in section.fields:
                d[name] = section.to_json(name, values[name]) if name in values else None
        return d
