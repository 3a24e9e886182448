"""Binary encoding of samples and batches: the bytes in the buffer's log and on the learner's wire.

A sample record is a small JSON header (ids, reward, flags, sizes) followed by raw little-endian
arrays: token ids (int32), behaviour logprobs (float32), then the loss mask and the per-token
policy versions run-length encoded as (value, length) int32 pairs, because both are long runs in
practice (prompt / generated turns, one version per weight update). A 2,048-token sample is thus
about 8 bytes per token plus a few hundred bytes of header; no number ever travels as JSON text.

A batch is ``MAGIC | u32 header length | JSON header | (u32 length | sample record)*``.

Invariants: ``decode_sample(encode_sample(s))`` equals ``s`` field by field, except that logprobs
round-trip through float32; records carry a format version and decoding rejects what it does not
know with :class:`CodecError` instead of guessing.
"""

from __future__ import annotations

import array
import json
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentrl.buffer.sample import Sample

FORMAT_VERSION = 1
BATCH_MAGIC = b"ARB1"
_U32 = struct.Struct("<I")
_BATCH_HEAD = struct.Struct("<4sI")
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_BIG_ENDIAN = sys.byteorder == "big"
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


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Run-length encode a 1-D int array into (values, lengths)."""
    n = values.shape[0]
    if n == 0:
        return np.zeros(0, _I32), np.zeros(0, _I32)
    change = np.flatnonzero(values[1:] != values[:-1]) + 1
    starts = np.concatenate(([0], change))
    lengths = np.diff(np.concatenate((starts, [n])))
    return values[starts].astype(_I32, copy=False), lengths.astype(_I32, copy=False)


def _as_array(xs: Any, dtype: np.dtype, typecode: str) -> np.ndarray:
    """A little-endian array from a list or array. ``array.array`` converts a list faster than numpy."""
    if isinstance(xs, np.ndarray):
        return np.ascontiguousarray(xs, dtype=dtype)
    arr = array.array(typecode, xs)
    if _BIG_ENDIAN:
        arr.byteswap()
    return np.frombuffer(arr, dtype=dtype)


def _as_mask(xs: Any) -> np.ndarray:
    if not isinstance(xs, np.ndarray):
        try:
            return np.frombuffer(bytes(xs), dtype=np.uint8)  # fastest for 0/1 lists
        except (ValueError, TypeError):
            pass
    return (np.asarray(xs) != 0).astype(np.uint8)


def _expand(values: np.ndarray, lengths: np.ndarray) -> list[int]:
    """Undo ``_runs`` into a list (runs are few, so list repetition beats numpy here)."""
    out: list[int] = []
    for v, n in zip(values.tolist(), lengths.tolist(), strict=True):
        out += [v] * n
    return out


def _version_runs_from_mask(versions: Any, mask_vals: np.ndarray,
                            mask_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Version runs without converting the whole list: versions are usually constant on each run
    of the loss mask (one version per turn, -1 on prompt and tool tokens), which a C-speed slice
    comparison confirms; only runs that are not (a turn that crossed a weight update) are converted.
    None for non-list input."""
    if not isinstance(versions, list):
        return None
    vals: list[int] = []
    lens: list[int] = []
    min_version: int | None = None
    pos = 0
    for m, n in zip(mask_vals.tolist(), mask_lens.tolist(), strict=True):
        chunk = versions[pos : pos + n]
        v = chunk[0]
        if chunk == [v] * n:
            sub = [(v, n)]
        else:
            cv, cl = _runs(np.frombuffer(array.array("i", chunk), dtype=np.int32))
            sub = list(zip(cv.tolist(), cl.tolist(), strict=True))
        for v, k in sub:
            if m and (min_version is None or v < min_version):
                min_version = v
            if vals and vals[-1] == v:
                lens[-1] += k
            else:
                vals.append(v)
                lens.append(k)
        pos += n
    try:
        return np.array(vals, _I32), np.array(lens, _I32), -1 if min_version is None else int(min_version)
    except (OverflowError, TypeError, ValueError):
        return None


def encode_sample(sample: Sample) -> tuple[bytes, dict[str, Any]]:
    """Encode one sample; returns the record and its header (which carries ``min_version``)."""
    tokens = _as_array(sample.token_ids, _I32, "i")
    logprobs = _as_array(sample.logprobs, _F32, "f")
    mask = _as_mask(sample.loss_mask)
    mask_vals, mask_lens = _runs(mask)
    fast = _version_runs_from_mask(sample.versions, mask_vals, mask_lens)
    if fast is not None:
        ver_vals, ver_lens, min_version = fast
    else:
        versions = _as_array(sample.versions, _I32, "i")
        generated = versions[mask != 0]
        min_version = int(generated.min()) if generated.size else -1
        ver_vals, ver_lens = _runs(versions)
    head = {
        "v": FORMAT_VERSION,
        "n": int(tokens.shape[0]),
        "km": int(mask_vals.shape[0]),
        "kv": int(ver_vals.shape[0]),
        "min_version": min_version,
        "sample_id": sample.sample_id,
        "episode_id": sample.episode_id,
        "group_id": sample.group_id,
        "env": sample.env,
        "reward": float(sample.reward),
        "truncated": bool(sample.truncated),
        "error": sample.error,
        "info": sample.info,
        "timings": sample.timings,
    }
    hb = json.dumps(head, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 4)  # keep the arrays 4-byte aligned
    parts = [_U32.pack(len(hb)), hb, tokens.tobytes(), logprobs.tobytes(), mask_vals.tobytes(),
             mask_lens.tobytes(), ver_vals.tobytes(), ver_lens.tobytes()]
    return b"".join(parts), head


def read_header(record: bytes | memoryview) -> dict[str, Any]:
    """The JSON header of a sample record, without decoding its arrays."""
    try:
        (hlen,) = _U32.unpack_from(record, 0)
        head = json.loads(bytes(record[4 : 4 + hlen]))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CodecError(f"unreadable sample header: {e}") from e
    if not isinstance(head, dict) or head.get("v") != FORMAT_VERSION:
        raise CodecError(f"unknown sample record format {head.get('v') if isinstance(head, dict) else head!r}")
    return head


def decode_sample(record: bytes | memoryview, as_arrays: bool = False) -> Sample:
    """Decode a record into a Sample with list fields, or (``as_arrays``) with writable numpy arrays
    (int32 token ids, mask and versions, float32 logprobs): cheaper, and what a learner turns into
    tensors without a copy (``torch.from_numpy``)."""
    head = read_header(record)
    (hlen,) = _U32.unpack_from(record, 0)
    n, km, kv = head["n"], head["km"], head["kv"]
    expected = 4 + hlen + 8 * n + 8 * km + 8 * kv
    if len(record) != expected:
        raise CodecError(f"sample {head.get('sample_id')}: record is {len(record)} bytes, expected {expected}")
    arr = np.frombuffer(record, dtype=np.uint8, offset=4 + hlen)
    off = 0

    def take(count: int, dtype: np.dtype) -> np.ndarray:
        nonlocal off
        out = arr[off : off + 4 * count].view(dtype)
        off += 4 * count
        return out

    tokens = take(n, _I32)
    logprobs = take(n, _F32)
    mask_runs = take(km, _I32), take(km, _I32)
    version_runs = take(kv, _I32), take(kv, _I32)
    if int(mask_runs[1].sum()) != n or int(version_runs[1].sum()) != n:
        raise CodecError(f"sample {head['sample_id']}: run lengths do not add up to {n} tokens")
    fields: dict[str, Any]
    if as_arrays:
        fields = {"token_ids": tokens.astype(np.int32), "logprobs": logprobs.astype(np.float32),
                  "loss_mask": np.repeat(*mask_runs).astype(np.int32),
                  "versions": np.repeat(*version_runs).astype(np.int32)}
    else:
        fields = {"token_ids": tokens.tolist(), "logprobs": logprobs.tolist(),
                  "loss_mask": _expand(*mask_runs), "versions": _expand(*version_runs)}
    return Sample(
        **fields,
        episode_id=head["episode_id"],
        group_id=head["group_id"],
        env=head["env"],
        reward=head["reward"],
        sample_id=head["sample_id"],
        truncated=head["truncated"],
        error=head["error"],
        info=head["info"],
        timings=head["timings"],
    )


def encode_batch_records(batch_id: str, learner_version: int, records: list[bytes],
                         info: dict[str, Any] | None = None) -> bytes:
    """Frame already-encoded sample records as a batch (what the HTTP route sends)."""
    head = json.dumps({"v": FORMAT_VERSION, "batch_id": batch_id, "learner_version": learner_version,
                       "n": len(records), "info": info or {}}, separators=(",", ":")).encode()
    parts = [_BATCH_HEAD.pack(BATCH_MAGIC, len(head)), head]
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
    if head.get("v") != FORMAT_VERSION:
        raise CodecError(f"unknown batch format {head.get('v')!r}")
    off = 8 + hlen
    samples = []
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
