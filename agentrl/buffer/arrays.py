"""The dtype rules of a sample's arrays: one place that turns what a caller gives into the arrays
the buffer stores.

Invariants: ids, masks and versions are 1-D int32 and never wrap (a value outside int32 is an
OverflowError); logprobs and other per-token floats are float32, rounded to nearest; an array that
already has the right dtype is returned as it is, without a copy. :func:`runs` and
:func:`pack_ints` are the run-length form records keep long runs in (masks, versions, kept counts).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

_I32 = np.iinfo(np.int32)


def int32_array(xs: ArrayLike, what: str) -> np.ndarray:
    """``xs`` as an int32 array; a value outside int32 is an OverflowError, never wrapped."""
    if isinstance(xs, np.ndarray):
        if xs.dtype == np.int32:
            return xs
        if xs.dtype.kind in "iu" and xs.size and (int(xs.min()) < _I32.min or int(xs.max()) > _I32.max):
            raise OverflowError(f"{what}: a value does not fit in int32")
        return xs.astype(np.int32)
    return np.asarray(xs, dtype=np.int32)  # a Python int out of range raises OverflowError here


def mask_array(xs: ArrayLike) -> np.ndarray:
    """The loss mask as int32. Bools and floats mean "generated or not" (nonzero becomes 1);
    integers keep their value (a weight of 2 stays 2)."""
    a = xs if isinstance(xs, np.ndarray) else np.asarray(xs)
    if a.dtype.kind in "bf":
        return (a != 0).astype(np.int32)
    return int32_array(a, "loss_mask")


def float32_array(xs: ArrayLike) -> np.ndarray:
    """Logprobs as float32, rounded to nearest; a finite value beyond float32 becomes +-inf."""
    if isinstance(xs, np.ndarray) and xs.dtype == np.float32:
        return xs
    with np.errstate(over="ignore"):  # the documented rounding, not an error
        return np.asarray(xs, dtype=np.float32)


def runs(a: np.ndarray) -> tuple[list[int], list[int]]:
    """Run-length encode a 1-D int32 array into (values, lengths): one comparison and one
    ``flatnonzero`` at C speed, the few runs in Python (cheaper than more numpy calls). Records
    keep loss masks, versions and kept counts this way: all are long runs in practice."""
    n = a.shape[0]
    if n == 0:
        return [], []
    cuts = (np.flatnonzero(a[1:] != a[:-1]) + 1).tolist()
    if not cuts:
        return [a[0].item()], [n]
    starts = [0, *cuts]
    return a[starts].tolist(), [e - s for s, e in zip(starts, [*cuts, n], strict=True)]


_structs: dict[int, struct.Struct] = {}


def pack_ints(values: list[int]) -> bytes:
    """Little-endian int32 bytes of a short list (the runs), with a cached ``struct.Struct``."""
    st = _structs.get(len(values))
    if st is None:
        if len(_structs) > 4096:
            _structs.clear()
        st = _structs[len(values)] = struct.Struct(f"<{len(values)}i")
    return st.pack(*values)
