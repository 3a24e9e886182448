"""The sample-section interface and its registry.

Role: a section is a feature's own data on a :class:`~agentrl.buffer.sample.Sample` (a per-token
array or a per-sample record), declared once, beside the feature, by subclassing :class:`Section`
and decorating the class with :func:`register`. The sample stores and validates a section's
values through it; the codec writes and reads a section's bytes through it, by name, in a record's
section table. Nothing else in the buffer names a feature, so adding a per-token signal is one new
module plus the code that reads it.

What a section declares ("override these"):

- ``name``: its key in a record's section table. It is on disk: renaming it orphans the section in
  old logs (a reader skips a name it does not know).
- ``fields``: the ``Sample`` attributes it holds (``sample.<field>``, None while unset; also
  keyword arguments of ``Sample(...)`` and ``dataclasses.replace``).
- ``check(values, tokens)``: the values of the fields that are set, for a sample of ``tokens``
  tokens; returns them normalised (dtypes) or raises ValueError saying what is wrong. Called on
  every construction of a sample that has the section (so on decoding too), never on assignment.
- ``encode(values)`` / ``decode(data, tokens)``: the section's bytes in a record and back
  (little-endian; ``decode`` gets exactly the bytes ``encode`` gave, raises ValueError on bytes
  that do not fit, and returns writable arrays).

Optional: ``equal`` (default: arrays by value, NaN equal to NaN in floats), ``to_json`` (default:
arrays as lists), and the section's tensor in the learner's micro-batch: ``fill`` (the padding
value; None, the default, gives the learner no tensor) and ``tensor(values)``, a per-token array
``[tokens, ...]`` (default: the section's one field). The learner pads it beside the token fields
and shifts it like them (:func:`agentrl.learner.microbatch.section_tensors`), for a loss term that
reads it (:mod:`agentrl.learner.terms`).

Invariants: a name and a field belong to one section; ``register`` refuses a second section that
claims either. The registry is ordered by registration, which is the order sections are written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from agentrl.buffer.arrays import float32_array

I32, F32 = np.dtype("<i4"), np.dtype("<f4")  # what records hold (little-endian)
Values = dict[str, Any]  # a section's fields that are set, by field name


class Section:
    """One feature's data on a sample; subclass, set ``name`` and ``fields``, override the four
    methods, and decorate with :func:`register`."""

    name: ClassVar[str]
    fields: ClassVar[tuple[str, ...]]

    # -- override these ---------------------------------------------------------------------------
    def check(self, values: Values, tokens: int) -> Values:
        raise NotImplementedError

    def encode(self, values: Values) -> bytes:
        raise NotImplementedError

    def decode(self, data: memoryview, tokens: int) -> Values:
        raise NotImplementedError

    # -- optional ---------------------------------------------------------------------------------
    def equal(self, a: Values, b: Values) -> bool:
        if a.keys() != b.keys():
            return False
        for k, x in a.items():
            y = b[k]
            if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
                if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
                        and np.array_equal(x, y, equal_nan=x.dtype.kind == "f" and y.dtype.kind == "f")):
                    return False
            elif x != y:
                return False
        return True

    def to_json(self, field: str, value: Any) -> Any:
        return value.tolist() if isinstance(value, np.ndarray) else value

    fill: ClassVar[float | None] = None  # the micro-batch tensor's padding value; None: no tensor

    def tensor(self, values: Values) -> np.ndarray:
        (field,) = self.fields
        return values[field]


_SECTIONS: dict[str, Section] = {}  # name -> section, in registration order
_FIELDS: dict[str, Section] = {}  # Sample attribute -> the section that holds it


def register(cls: type[Section]) -> type[Section]:
    """Class decorator: make ``cls`` a section every sample and record knows by its name."""
    section = cls()
    old = _SECTIONS.get(cls.name)
    if old is not None and _origin(type(old)) == _origin(cls):
        _forget(old)  # the same declaration imported again (a reloaded module): the new one wins
    clash = [f for f in cls.fields if f in _FIELDS] + ([cls.name] if cls.name in _SECTIONS else [])
    if clash or not cls.fields:
        raise ValueError(f"section {cls.name!r} ({cls.__module__}): "
                         + (f"{clash} already belong to another section" if clash else "declares no fields"))
    _SECTIONS[cls.name] = section
    _FIELDS.update(dict.fromkeys(cls.fields, section))
    return cls


def _origin(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def _forget(section: Section) -> None:
    del _SECTIONS[section.name]
    for f in section.fields:
        _FIELDS.pop(f, None)


def sections() -> Mapping[str, Section]:
    """The registered sections by name, in the order records write them."""
    return _SECTIONS


def holder(field: str) -> Section | None:
    """The section that holds the ``Sample`` attribute ``field`` (None: no section does)."""
    return _FIELDS.get(field)


class TokenFloats(Section):
    """A section of one float32 value per token (NaN where the feature has none): 4 bytes a token.
    Subclasses set ``name`` and ``fields`` (one field)."""

    def check(self, values: Values, tokens: int) -> Values:
        (field,) = self.fields
        a = float32_array(values[field])
        if a.shape != (tokens,):
            raise ValueError(f"{field.replace('_', ' ')} must be 1-D over its {tokens} tokens, not {a.shape}")
        return {field: a}

    def encode(self, values: Values) -> bytes:
        (field,) = self.fields
        return values[field].astype(F32, copy=False).tobytes()

    def decode(self, data: memoryview, tokens: int) -> Values:
        if len(data) != 4 * tokens:
            raise ValueError(f"{len(data)} bytes for {tokens} tokens of float32")
        (field,) = self.fields
        return {field: np.frombuffer(data, dtype=F32).astype(np.float32)}
