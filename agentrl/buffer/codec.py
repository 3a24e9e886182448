"""Binary encoding of samples and batches: the bytes in the buffer's log and on the learner's wire.

A sample record (format 2) is a fixed struct header, the sample's strings, a small JSON object
for the rare fields, then raw little-endian arrays::

    "ARS2" | n, km, kv (u32) | min_version (i32) | reward (f64) | truncated (u8) | 3 pad
           | byte lengths of sample_id, episode_id, group_id, env, JSON (u32 x 5)
    | utf-8 strings | JSON {"error", "error_kind", "info", "timings"}, non-default keys only (may be empty)
    | pad to 4 | token ids (i32 x n) | logprobs (f32 x n)
    | loss mask runs: values (i32 x km), lengths (i32 x km) | version runs: values, lengths (kv each)

The loss mask and the per-token policy versions travel run-length encoded because both are long
runs in practice (prompt / generated turns, one version per weight update). A 2,048-token sample is
about 8 bytes per token plus a few dozen bytes of header; no number ever travels as JSON text.

The rollout hands over numpy arrays (int32/float32): their bytes are written as they are, and
their mask and version runs come from one comparison each. For Python lists, converting them is
the whole cost of a put, so the list path avoids numpy: ``struct``
packs and unpacks the token ids and logprobs (about twice as fast as ``array.array`` or numpy for
a list), and runs are found by comparing list slices at C speed instead of converting the mask
and versions at all. Anything unusual (other sequence types, many runs, values a fast path does
not recognise) takes the general numpy/``array`` path, which gives the same bytes.

A batch is ``MAGIC | u32 header length | JSON header | (u32 length | sample record)*``.

Invariants: ``decode_sample(encode_sample(s))`` equals ``s`` field by field, except that logprobs
round-trip through float32 (rounded to nearest, as a C ``(float)`` cast; a finite value beyond
float32 becomes +-inf) and a loss mask of bools or floats comes back as 0/1 ints. Records of
format 1 (a JSON header; logs written before format 2) are still read. Decoding rejects what it
does not know with :class:`CodecError` instead of guessing.
"""

from __future__ import annotations

import array
import contextlib
import gc
import json
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentrl.buffer.sample import Sample

FORMAT_VERSION = 2
BATCH_MAGIC = b"ARB1"
RECORD_MAGIC = b"ARS2"
_U32 = struct.Struct("<I")
_BATCH_HEAD = struct.Struct("<4sI")
_HEAD = struct.Struct("<4sIIIidB3xIIIII")
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_BIG_ENDIAN = sys.byteorder == "big"
_MAX_LIST_RUNS = 256  # beyond this many version runs in a list, numpy finds them faster
assert array.array("i").itemsize == 4 and array.array("f").itemsize == 4


class CodecError(ValueError):
    """Bytes that are not a sample or batch this version can read."""


@dataclass
class Batch:
    """Samples leased to the learner under ``batch_id`` until it acknowledges them."""

    batch_id: str
    samples: list[Sample]
    learner_version: int
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)


# ---------------------------------------------------------------------------- packing helpers

_structs: dict[tuple[int, str], struct.Struct] = {}


def _struct(n: int, code: str) -> struct.Struct:
    """A cached ``struct.Struct`` for n little-endian values of ``code``."""
    s = _structs.get((n, code))
    if s is None:
        if len(_structs) > 4096:
            _structs.clear()
        s = _structs[(n, code)] = struct.Struct(f"<{n}{code}")
    return s


def _as_array(xs: Any, dtype: np.dtype, typecode: str) -> np.ndarray:
    """A little-endian array from a list or array (the general path)."""
    if isinstance(xs, np.ndarray):
        return np.ascontiguousarray(xs, dtype=dtype)
    arr = array.array(typecode, xs)
    if _BIG_ENDIAN:
        arr.byteswap()
    return np.frombuffer(arr, dtype=dtype)


def _pack(xs: Any, dtype: np.dtype, typecode: str) -> bytes:
    """Little-endian int32 (``typecode`` "i") or float32 ("f") bytes of a per-token field.

    ``struct`` packs a list about twice as fast as ``array.array``; where it refuses a value
    (out of range, not a number) the ``array`` path decides, so results and errors are the same.
    """
    if isinstance(xs, list):
        try:
            return _struct(len(xs), typecode).pack(*xs)
        except (struct.error, OverflowError):
            pass
    return _as_array(xs, dtype, typecode).tobytes()


def _run_end(xs: list[Any], pos: int, v: Any, n: int) -> int:
    """The first index at or after ``pos`` whose element is not equal to ``v`` (or n), found by
    galloping then bisecting with slice comparisons, which run at C speed."""
    lo, step = pos + 1, 32
    while True:  # grow a window [lo, hi) until it holds a different element
        hi = min(lo + step, n)
        if xs[lo:hi] != [v] * (hi - lo):
            break
        if hi == n:
            return n
        lo, step = hi, step * 4
    while hi - lo > 8:  # xs[pos:lo] all equal v; the first difference is in [lo, hi)
        mid = (lo + hi) // 2
        if xs[lo:mid] == [v] * (mid - lo):
            lo = mid
        else:
            hi = mid
    while xs[lo] == v:
        lo += 1
    return lo


def _version_list_runs(xs: Any, mask_lengths: list[int]) -> tuple[list[int], list[int]] | None:
    """Run-length encode a list of int32 versions without converting it. Versions are usually
    constant on each run of the loss mask (one version per turn, -1 on prompt and tool tokens),
    which one slice comparison per mask run confirms; a run that is not (a turn that crossed a
    weight update) is split by galloping. None where the general path must decide (not a list,
    many runs, a value that is not an int32 int)."""
    if not isinstance(xs, list):
        return None
    vals: list[int] = []
    lens: list[int] = []
    pos = 0
    for k in mask_lengths:
        end = pos + k
        while pos < end:
            v = xs[pos]
            if type(v) is not int or not _I32_MIN <= v <= _I32_MAX:
                return None
            stop = end if xs[pos:end] == [v] * (end - pos) else _run_end(xs, pos, v, end)
            if vals and vals[-1] == v:
                lens[-1] += stop - pos
            elif len(vals) == _MAX_LIST_RUNS:
                return None
            else:
                vals.append(v)
                lens.append(stop - pos)
            pos = stop
    return vals, lens


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Run-length encode a 1-D int array into (values, lengths)."""
    n = values.shape[0]
    if n == 0:
        return np.zeros(0, _I32), np.zeros(0, _I32)
    change = np.flatnonzero(values[1:] != values[:-1]) + 1
    starts = np.concatenate(([0], change))
    lengths = np.diff(np.concatenate((starts, [n])))
    return values[starts].astype(_I32, copy=False), lengths.astype(_I32, copy=False)


def _array_runs(a: np.ndarray) -> tuple[list[int], list[int]]:
    """Run-length encode a 1-D array into (values, lengths) lists: one comparison and one
    ``flatnonzero`` at C speed, the few runs in Python (cheaper than more numpy calls)."""
    n = a.shape[0]
    if n == 0:
        return [], []
    cuts = (np.flatnonzero(a[1:] != a[:-1]) + 1).tolist()
    if not cuts:
        return [a[0].item()], [n]
    starts = [0, *cuts]
    return a[starts].tolist(), [e - s for s, e in zip(starts, [*cuts, n], strict=True)]


def _byte_runs(raw: bytes) -> tuple[list[int], list[int]]:
    """Runs of a byte string of 0s and 1s, found with ``bytes.find`` at C speed."""
    vals, lens, pos, n = [], [], 0, len(raw)
    while pos < n:
        v = raw[pos]
        end = raw.find(1 - v, pos)
        end = n if end < 0 else end
        vals.append(v)
        lens.append(end - pos)
        pos = end
    return vals, lens


def _mask_runs(xs: Any) -> tuple[list[int], list[int]]:
    mask: np.ndarray | None = None
    if isinstance(xs, np.ndarray) and xs.ndim == 1:
        return _byte_runs((xs != 0).view(np.uint8).tobytes())
    if not isinstance(xs, np.ndarray):
        try:
            raw = bytes(xs)  # keeps small ints as they are; the fastest look at a list of 0/1
        except (ValueError, TypeError):
            pass
        else:
            if not raw.translate(None, b"\x00\x01"):  # only 0 and 1: find the runs at C speed
                return _byte_runs(raw)
            mask = np.frombuffer(raw, dtype=np.uint8)
    if mask is None:
        mask = (np.asarray(xs) != 0).astype(np.uint8)
    vals_a, lens_a = _runs(mask)
    return vals_a.tolist(), lens_a.tolist()


def _version_runs(xs: Any, mask_lengths: list[int]) -> tuple[list[int], list[int]]:
    fast = _version_list_runs(xs, mask_lengths)
    if fast is not None:
        return fast
    arr = _as_array(xs, _I32, "i")
    if arr.ndim != 1:
        raise ValueError(f"versions must be 1-D, got shape {arr.shape}")
    return _array_runs(arr)


def _min_generated(mask: tuple[list[int], list[int]], versions: tuple[list[int], list[int]]) -> int:
    """The oldest version on tokens with a nonzero mask (-1 if none), from the two run lists."""
    best: int | None = None
    mv, ml = mask
    vv, vl = versions
    i = j = 0
    mend, vend = (ml[0] if ml else 0), (vl[0] if vl else 0)
    while i < len(mv) and j < len(vv):  # mask run i and version run j overlap (runs are not empty)
        if mv[i] and (best is None or vv[j] < best):
            best = vv[j]
        step_mask, step_versions = mend <= vend, vend <= mend
        if step_mask:
            i += 1
            mend += ml[i] if i < len(ml) else 0
        if step_versions:
            j += 1
            vend += vl[j] if j < len(vl) else 0
    return -1 if best is None else best


def _expand(values: tuple[int, ...] | list[int], lengths: tuple[int, ...] | list[int]) -> list[int]:
    """Undo the run-length encoding into a list (runs are few; list repetition is C speed)."""
    if len(values) == 1:
        return [values[0]] * lengths[0]
    out: list[int] = []
    for v, k in zip(values, lengths, strict=True):
        out += [v] * k
    return out


# ---------------------------------------------------------------------------- samples

def encode_sample(sample: Sample) -> tuple[bytes, dict[str, Any]]:
    """Encode one sample; returns the record and its header (which carries ``min_version``)."""
    return encode_with_prefix(sample)


def encode_with_prefix(sample: Sample, prefix: bytes = b"") -> tuple[bytes, dict[str, Any]]:
    """``encode_sample``, with ``prefix`` put before the record in the same bytes (the buffer's
    arrival time), which saves copying the record once more."""
    n = len(sample.token_ids)
    tokens = _pack(sample.token_ids, _I32, "i")
    logprobs = _pack(sample.logprobs, _F32, "f")
    if len(tokens) != 4 * n or len(logprobs) != 4 * n:
        raise ValueError(f"sample {sample.sample_id}: token ids and logprobs must be 1-D of length {n}")
    mask = _mask_runs(sample.loss_mask)
    versions = _version_runs(sample.versions, mask[1])
    if sum(mask[1]) != n or sum(versions[1]) != n:
        raise ValueError(f"sample {sample.sample_id}: loss mask and versions must be 1-D of length {n}")
    min_version = _min_generated(mask, versions)
    rare: dict[str, Any] = {}
    if sample.error is not None:
        rare["error"] = sample.error
    if sample.error_kind is not None:
        rare["error_kind"] = sample.error_kind
    if sample.info:
        rare["info"] = sample.info
    if sample.timings:
        rare["timings"] = sample.timings
    rb = json.dumps(rare, separators=(",", ":")).encode() if rare else b""
    sid, eid, gid, env = (sample.sample_id.encode(), sample.episode_id.encode(), sample.group_id.encode(),
                          sample.env.encode())
    km, kv = len(mask[0]), len(versions[0])
    strings = sid + eid + gid + env + rb
    head = _HEAD.pack(RECORD_MAGIC, n, km, kv, min_version, float(sample.reward), bool(sample.truncated),
                      len(sid), len(eid), len(gid), len(env), len(rb))
    runs = _struct(2 * km + 2 * kv, "i").pack(*mask[0], *mask[1], *versions[0], *versions[1])
    pad = b" " * (-len(strings) % 4)  # keeps the arrays 4-byte aligned (the fixed header is 52 bytes)
    record = b"".join((prefix, head, strings, pad, tokens, logprobs, runs))
    meta = {"v": FORMAT_VERSION, "n": n, "km": km, "kv": kv, "min_version": min_version,
            "sample_id": sample.sample_id, "episode_id": sample.episode_id, "group_id": sample.group_id,
            "env": sample.env, "reward": float(sample.reward), "truncated": bool(sample.truncated),
            "error": sample.error, "error_kind": sample.error_kind, "info": sample.info, "timings": sample.timings}
    return record, meta


def _parse(record: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """The header of a record of either format, and the offset of its arrays."""
    if bytes(record[:4]) == RECORD_MAGIC:
        try:
            (_, n, km, kv, min_version, reward, truncated, lsid, leid, lgid, lenv,
             lrare) = _HEAD.unpack_from(record, 0)
            off = _HEAD.size
            raw = bytes(record[off : off + lsid + leid + lgid + lenv + lrare])
            strings = raw[: lsid + leid + lgid + lenv].decode()
            rare = json.loads(raw[lsid + leid + lgid + lenv :]) if lrare else {}
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CodecError(f"unreadable sample header: {e}") from e
        if len(raw) != lsid + leid + lgid + lenv + lrare or not isinstance(rare, dict):
            raise CodecError("unreadable sample header: truncated or malformed")
        a, b, c = lsid, lsid + leid, lsid + leid + lgid
        head = {"v": FORMAT_VERSION, "n": n, "km": km, "kv": kv, "min_version": min_version,
                "sample_id": strings[:a], "episode_id": strings[a:b], "group_id": strings[b:c],
                "env": strings[c:], "reward": reward, "truncated": bool(truncated),
                "error": rare.get("error"), "error_kind": rare.get("error_kind"), "info": rare.get("info", {}),
                "timings": rare.get("timings", {})}
        if len(strings) != len(raw) - lrare:  # non-ASCII ids: slice by bytes, not characters
            sb = raw[: lsid + leid + lgid + lenv]
            head.update(sample_id=sb[:a].decode(), episode_id=sb[a:b].decode(), group_id=sb[b:c].decode(),
                        env=sb[c:].decode())
        used = off + lsid + leid + lgid + lenv + lrare
        return head, used + (-used % 4)
    try:
        (hlen,) = _U32.unpack_from(record, 0)
        head = json.loads(bytes(record[4 : 4 + hlen]))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CodecError(f"unreadable sample header: {e}") from e
    if not isinstance(head, dict) or head.get("v") != 1:
        raise CodecError(f"unknown sample record format {head.get('v') if isinstance(head, dict) else head!r}")
    return head, 4 + hlen


def read_header(record: bytes | memoryview) -> dict[str, Any]:
    """The header of a sample record (ids, reward, flags, info, timings, sizes, min_version),
    without decoding its arrays."""
    return _parse(record)[0]


def decode_sample(record: bytes | memoryview, as_arrays: bool = False) -> Sample:
    """Decode a record into a Sample with list fields, or (``as_arrays``) with writable numpy arrays
    (int32 token ids, mask and versions, float32 logprobs): cheaper, and what a learner turns into
    tensors without a copy (``torch.from_numpy``)."""
    head, off = _parse(record)
    n, km, kv = head["n"], head["km"], head["kv"]
    if len(record) != off + 8 * n + 8 * km + 8 * kv:
        raise CodecError(f"sample {head.get('sample_id')}: record is {len(record)} bytes, "
                         f"expected {off + 8 * n + 8 * km + 8 * kv}")
    fields: dict[str, Any]
    if as_arrays:
        arr = np.frombuffer(record, dtype=np.uint8, offset=off)
        ints = arr[8 * n :].view(_I32)
        mask_runs, version_runs = (ints[:km], ints[km : 2 * km]), (ints[2 * km : 2 * km + kv], ints[2 * km + kv :])
        _check_lengths(head, n, mask_runs[1].tolist(), version_runs[1].tolist())
        fields = {"token_ids": arr[: 4 * n].view(_I32).astype(np.int32),
                  "logprobs": arr[4 * n : 8 * n].view(_F32).astype(np.float32),
                  "loss_mask": np.repeat(*mask_runs).astype(np.int32),
                  "versions": np.repeat(*version_runs).astype(np.int32)}
    else:
        runs = _struct(2 * km + 2 * kv, "i").unpack_from(record, off + 8 * n)
        mv, ml, vv, vl = runs[:km], runs[km : 2 * km], runs[2 * km : 2 * km + kv], runs[2 * km + kv :]
        _check_lengths(head, n, ml, vl)
        fields = {"token_ids": _unpack_list(record, off, n, "i"),
                  "logprobs": _logprob_list(record, off + 4 * n, n, mv, ml),
                  "loss_mask": _expand(mv, ml), "versions": _expand(vv, vl)}
    return Sample(
        **fields,
        episode_id=head["episode_id"],
        group_id=head["group_id"],
        env=head["env"],
        reward=head["reward"],
        sample_id=head["sample_id"],
        truncated=head["truncated"],
        error=head["error"],
        error_kind=head.get("error_kind"),
        info=head["info"],
        timings=head["timings"],
    )


def _unpack_list(record: bytes | memoryview, off: int, n: int, typecode: str) -> list[Any]:
    """n little-endian int32 ("i") or float32 ("f") values as a list; ``array`` builds the list
    without the intermediate tuple ``struct`` would."""
    arr = array.array(typecode)
    arr.frombytes(memoryview(record)[off : off + 4 * n])
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tolist()


def _logprob_list(record: bytes | memoryview, off: int, n: int, mask_values: Any, mask_lengths: Any) -> list[float]:
    """The logprobs as a list. Tokens outside the loss mask (prompt, tool output) carry 0.0, so
    such a run whose bytes are all zero becomes one shared 0.0 repeated: no float per token to
    allocate, and none for the garbage collector to visit. Other runs are converted."""
    if len(mask_values) == 1 or not any(v == 0 for v in mask_values):
        return _unpack_list(record, off, n, "f")
    view = memoryview(record)
    out: list[float] = []
    for v, k in zip(mask_values, mask_lengths, strict=True):
        if v == 0 and not view[off : off + 4 * k].tobytes().strip(b"\x00"):
            out += [0.0] * k
        else:
            out += _unpack_list(record, off, k, "f")
        off += 4 * k
    return out


def _check_lengths(head: dict[str, Any], n: int, mask_lengths: Any, version_lengths: Any) -> None:
    if sum(mask_lengths) != n or sum(version_lengths) != n or min((*mask_lengths, *version_lengths, 0)) < 0:
        raise CodecError(f"sample {head['sample_id']}: run lengths do not add up to {n} tokens")


# ---------------------------------------------------------------------------- batches

@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a batch's samples are built.

    Decoding a batch to lists allocates four 2,048-element lists per sample; every 700 container
    allocations the collector runs and walks every reference of every young list, so a 256-sample
    batch paid several collections (and their knock-on older-generation ones) for lists that hold
    no cycles. Paused, the batch is walked once by the next collection. Re-enables only what it
    disabled.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def encode_batch_records(batch_id: str, learner_version: int, records: list[bytes] | list[memoryview],
                         info: dict[str, Any] | None = None) -> bytes:
    """Frame already-encoded sample records as a batch (what the HTTP route sends)."""
    head = json.dumps({"v": 1, "batch_id": batch_id, "learner_version": learner_version,
                       "n": len(records), "info": info or {}}, separators=(",", ":")).encode()
    parts: list[bytes | memoryview] = [_BATCH_HEAD.pack(BATCH_MAGIC, len(head)), head]
    for r in records:
        parts.append(_U32.pack(len(r)))
        parts.append(r)
    return b"".join(parts)


def encode_batch(batch: Batch) -> bytes:
    return encode_batch_records(batch.batch_id, batch.learner_version,
                                [encode_sample(s)[0] for s in batch.samples], batch.info)


def decode_batch(data: bytes | memoryview, as_arrays: bool = False) -> Batch:
    """Decode a batch; ``as_arrays`` as in ``decode_sample``."""
    view = memoryview(data)
    try:
        magic, hlen = _BATCH_HEAD.unpack_from(view, 0)
    except struct.error as e:
        raise CodecError(f"batch too short ({len(view)} bytes)") from e
    if magic != BATCH_MAGIC:
        raise CodecError(f"not a batch (magic {bytes(magic)!r})")
    try:
        head = json.loads(bytes(view[8 : 8 + hlen]))
    except ValueError as e:
        raise CodecError(f"unreadable batch header: {e}") from e
    if head.get("v") != 1:
        raise CodecError(f"unknown batch format {head.get('v')!r}")
    off = 8 + hlen
    samples = []
    with gc_paused():
        for _ in range(head["n"]):
            if off + 4 > len(view):
                raise CodecError("batch truncated")
            (rlen,) = _U32.unpack_from(view, off)
            off += 4
            if off + rlen > len(view):
                raise CodecError("batch truncated")
            samples.append(decode_sample(view[off : off + rlen], as_arrays))
            off += rlen
    if off != len(view):
        raise CodecError(f"{len(view) - off} trailing bytes after batch")
    return Batch(batch_id=head["batch_id"], samples=samples, learner_version=head["learner_version"],
                 info=head.get("info", {}))
