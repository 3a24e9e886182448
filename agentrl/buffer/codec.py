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

A sample with a :class:`~agentrl.buffer.behaviour.Behaviour` is a format-3 record: magic "ARS3",
the format-2 header followed by four more u32 (calls C, kept-count runs kk, kept ids nk, kept-id
width w: 2 when every id fits in a u16, else 4), the format-2 body, then::

    | call starts (i32 x C) | call lengths (i32 x C) | call settings (f32 x 7C, behaviour.PARAMS)
    | kept-count runs: values (i32 x kk), lengths (i32 x kk) | kept ids (u16 or i32 x nk) | pad to 4

Kept counts are long runs too (0 on prompts, top_k on most tokens of a top-k call), so a call
costs 36 bytes and a truncated token about ``w * top_k`` bytes (top_k 20 on a 49k vocabulary:
40 bytes a token); a sample without truncation pays a few dozen bytes in all.

A sample with a routing (an MoE model's recorded experts, [n, layers L, k]) is a format-4 record:
magic "ARS4", the format-3 header followed by three more u32 (L, k, expert-id width rw: 1 for
uint8 ids, 2 for int16), the format-3 body (its behaviour section only when the kept-id width is
not 0), then the ids, C order, and a pad to 4. A top-2 routing over 24 MoE layers costs 48 bytes a
token (uint8 up to 255 experts; 255 or -1 marks a position the engine did not record).

A sample with per-token float sections is a format-5 record: magic "ARS5", the format-4 header
followed by one more u32, a bitmask of the sections that follow (1: the teacher's logprobs, for
on-policy distillation; 2: token rewards, a process scorer's; 4: the teacher's top-k), the
format-4 body (its behaviour and routing sections each present only when their width is not 0),
then the float sections in bit order, f32 x n (NaN where nothing was scored): 4 bytes a token
each; then, with bit 4, k (u32), the top-k ids (i32 x n*k, -1 where none) and their logprobs
(f32 x n*k), C order: 8k bytes a token.

The per-token fields are numpy arrays (``Sample`` guarantees int32/float32): their bytes are
written as they are (on a little-endian machine, without conversion), and the mask and version
runs come from one comparison each. Decoding gives writable arrays (one copy out of the record,
so a learner may turn them into tensors in place with ``torch.from_numpy``).

A batch is ``MAGIC | u32 header length | JSON header | (u32 length | sample record)*``.

Invariants: ``decode_sample(encode_sample(s))`` equals ``s`` field by field, except that logprobs
round-trip through float32 (rounded to nearest, as a C ``(float)`` cast; a finite value beyond
float32 becomes +-inf) and a loss mask of bools or floats comes back as 0/1 ints (both done by
``Sample`` itself). Records of format 1 (a JSON header; logs written before format 2) and format 2
(samples without a behaviour, and every record written before format 3) and format 3 are still
read; a sample without a behaviour, routing or float section is still written as format 2, one
with a behaviour and none of the others as format 3, one with a routing and no float section as
format 4.
Decoding rejects what it does not know with :class:`CodecError` instead of guessing.
"""

from __future__ import annotations

import contextlib
import gc
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentrl.buffer.behaviour import PARAMS, Behaviour
from agentrl.buffer.sample import Sample
from agentrl.errors import AgentrlError

FORMAT_VERSION = 5
BATCH_MAGIC = b"ARB1"
RECORD_MAGIC = b"ARS2"
BEHAVIOUR_MAGIC = b"ARS3"  # a format-2 record with a behaviour section
ROUTING_MAGIC = b"ARS4"  # a format-3 record (its behaviour section optional) with a routing section
FLOATS_MAGIC = b"ARS5"  # a format-4 record (behaviour and routing optional) with per-token float sections
_FLOATS = (("teacher_logprobs", 1), ("token_rewards", 2))  # Sample field, its bit in the sections mask
_TOPK = 4  # the sections mask's bit of the teacher's top-k (Sample.teacher_topk_ids and _logprobs)
_U32 = struct.Struct("<I")
_BATCH_HEAD = struct.Struct("<4sI")
_HEAD = struct.Struct("<4sIIIidB3xIIIII")
_HEAD3 = struct.Struct("<4sIIIidB3xIIIIIIIII")
_HEAD4 = struct.Struct("<4sIIIidB3xIIIIIIIIIIII")
_HEAD5 = struct.Struct("<4sIIIidB3xIIIIIIIIIIIII")
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U16 = np.dtype("<u2")
_I16 = np.dtype("<i2")
_HEADS = {RECORD_MAGIC: (2, _HEAD), BEHAVIOUR_MAGIC: (3, _HEAD3), ROUTING_MAGIC: (4, _HEAD4),
          FLOATS_MAGIC: (5, _HEAD5)}
_NP = len(PARAMS)


class CodecError(AgentrlError, ValueError):
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

_structs: dict[int, struct.Struct] = {}


def _le(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` as little-endian ``dtype`` (the same array when it already is: no copy on this side
    of a little-endian machine; ``tobytes`` then copies once, contiguous or not)."""
    return a.astype(dtype, copy=False)


def _pack_ints(values: list[int]) -> bytes:
    """Little-endian int32 bytes of a short list (the runs), with a cached ``struct.Struct``."""
    st = _structs.get(len(values))
    if st is None:
        if len(_structs) > 4096:
            _structs.clear()
        st = _structs[len(values)] = struct.Struct(f"<{len(values)}i")
    return st.pack(*values)


def _runs(a: np.ndarray) -> tuple[list[int], list[int]]:
    """Run-length encode a 1-D int32 array into (values, lengths): one comparison and one
    ``flatnonzero`` at C speed, the few runs in Python (cheaper than more numpy calls)."""
    n = a.shape[0]
    if n == 0:
        return [], []
    cuts = (np.flatnonzero(a[1:] != a[:-1]) + 1).tolist()
    if not cuts:
        return [a[0].item()], [n]
    starts = [0, *cuts]
    return a[starts].tolist(), [e - s for s, e in zip(starts, [*cuts, n], strict=True)]


def _min_generated(mask: tuple[list[int], list[int]], versions: tuple[list[int], list[int]]) -> int:
    """The oldest version on tokens with a nonzero mask (-1 if none), from the two run lists
    (a walk over the few runs, instead of a pass over every token)."""
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


# ---------------------------------------------------------------------------- samples

def encode_sample(sample: Sample) -> tuple[bytes, dict[str, Any]]:
    """Encode one sample; returns the record and its header (which carries ``min_version``)."""
    return encode_with_prefix(sample)


def encode_with_prefix(sample: Sample, prefix: bytes = b"") -> tuple[bytes, dict[str, Any]]:
    """``encode_sample``, with ``prefix`` put before the record in the same bytes (the buffer's
    arrival time), which saves copying the record once more."""
    n = len(sample.token_ids)
    mv, ml = _runs(sample.loss_mask)
    vv, vl = _runs(sample.versions)
    min_version = _min_generated((mv, ml), (vv, vl))
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
    km, kv = len(mv), len(vv)
    strings = sid + eid + gid + env + rb
    b, r = sample.behaviour, sample.routing
    tail: tuple[bytes, ...] = ()
    bfields = (0, 0, 0, 0)  # calls, kept-count runs, kept ids, kept-id width: no behaviour section
    if b is not None:
        cv, cl = _runs(b.kept_counts)
        nk = b.kept_ids.shape[0]
        wide = bool(nk) and (int(b.kept_ids.max()) > 0xFFFF or int(b.kept_ids.min()) < 0)
        ids = _le(b.kept_ids, _I32) if wide else b.kept_ids.astype(_U16)
        bfields = (b.calls, len(cv), nk, 4 if wide else 2)
        body = ids.tobytes()
        tail = (_le(b.starts, _I32).tobytes(), _le(b.lengths, _I32).tobytes(), _le(b.params, _F32).tobytes(),
                _pack_ints(cv + cl), body, b"\0" * (-len(body) % 4))
    fixed = (n, km, kv, min_version, float(sample.reward), bool(sample.truncated),
             len(sid), len(eid), len(gid), len(env), len(rb))
    rfields = (0, 0, 0)  # layers, k, expert-id width: no routing section
    if r is not None:
        rw = r.dtype.itemsize
        rfields = (r.shape[1], r.shape[2], rw)
        routed = (r if rw == 1 else _le(r, _I16)).tobytes()
        tail = (*tail, routed, b"\0" * (-len(routed) % 4))
    floats = [(bit, a) for name, bit in _FLOATS if (a := getattr(sample, name)) is not None]
    topk = sample.teacher_topk_ids
    if floats or topk is not None:
        sections = sum(bit for bit, _ in floats) | (_TOPK if topk is not None else 0)
        head, version = _HEAD5.pack(FLOATS_MAGIC, *fixed, *bfields, *rfields, sections), 5
        tail = (*tail, *(_le(a, _F32).tobytes() for _, a in floats))
        if topk is not None:
            tail = (*tail, _U32.pack(topk.shape[1]), _le(topk, _I32).tobytes(),
                    _le(sample.teacher_topk_logprobs, _F32).tobytes())
    elif r is not None:
        head, version = _HEAD4.pack(ROUTING_MAGIC, *fixed, *bfields, *rfields), 4
    elif b is not None:
        head, version = _HEAD3.pack(BEHAVIOUR_MAGIC, *fixed, *bfields), 3
    else:
        head, version = _HEAD.pack(RECORD_MAGIC, *fixed), 2
    pad = b" " * (-len(strings) % 4)  # keeps the arrays 4-byte aligned (the fixed headers are 52, 68, 80, 84 bytes)
    record = b"".join((prefix, head, strings, pad, _le(sample.token_ids, _I32).tobytes(),
                       _le(sample.logprobs, _F32).tobytes(), _pack_ints(mv + ml + vv + vl), *tail))
    meta = {"v": version, "n": n, "km": km, "kv": kv, "min_version": min_version,
            "sample_id": sample.sample_id, "episode_id": sample.episode_id, "group_id": sample.group_id,
            "env": sample.env, "reward": float(sample.reward), "truncated": bool(sample.truncated),
            "error": sample.error, "error_kind": sample.error_kind, "info": sample.info, "timings": sample.timings}
    return record, meta


def _parse(record: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """The header of a record of either format, and the offset of its arrays."""
    magic = bytes(record[:4])
    if magic in _HEADS:
        version, st = _HEADS[magic]
        try:
            (_, n, km, kv, min_version, reward, truncated, lsid, leid, lgid, lenv,
             lrare, *extra) = st.unpack_from(record, 0)
            off = st.size
            raw = bytes(record[off : off + lsid + leid + lgid + lenv + lrare])
            strings = raw[: lsid + leid + lgid + lenv].decode()
            rare = json.loads(raw[lsid + leid + lgid + lenv :]) if lrare else {}
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CodecError(f"unreadable sample header: {e}") from e
        if len(raw) != lsid + leid + lgid + lenv + lrare or not isinstance(rare, dict):
            raise CodecError("unreadable sample header: truncated or malformed")
        a, b, c = lsid, lsid + leid, lsid + leid + lgid
        head = {"v": version, "n": n, "km": km, "kv": kv, "min_version": min_version,
                "sample_id": strings[:a], "episode_id": strings[a:b], "group_id": strings[b:c],
                "env": strings[c:], "reward": reward, "truncated": bool(truncated),
                "error": rare.get("error"), "error_kind": rare.get("error_kind"), "info": rare.get("info", {}),
                "timings": rare.get("timings", {}), "calls": 0, "kk": 0, "nk": 0, "w": 0,
                "layers": 0, "k": 0, "rw": 0, "floats": 0}
        head.update(zip(("calls", "kk", "nk", "w", "layers", "k", "rw", "floats"), extra, strict=False))
        if head["w"] not in ((2, 4) if version == 3 else (0, 2, 4)) or (head["w"] == 0 and head["calls"] + head["kk"]):
            raise CodecError(f"sample {head['sample_id']}: kept ids of {head['w']} bytes")
        if head["rw"] not in ((1, 2) if version == 4 else (0, 1, 2)) or (head["rw"] == 0 and head["layers"] + head["k"]):
            raise CodecError(f"sample {head['sample_id']}: expert ids of {head['rw']} bytes")
        known = sum(bit for _, bit in _FLOATS) | _TOPK
        if version == 5 and (head["floats"] == 0 or head["floats"] & ~known):
            raise CodecError(f"sample {head['sample_id']}: unknown float sections {head['floats']:#x}")
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


def decode_sample(record: bytes | memoryview) -> Sample:
    """Decode a record into a Sample whose per-token fields are writable numpy arrays (int32 token
    ids, mask and versions, float32 logprobs): what a learner turns into tensors without a copy
    (``torch.from_numpy``)."""
    head, off = _parse(record)
    n, km, kv = head["n"], head["km"], head["kv"]
    end = off + 8 * n + 8 * km + 8 * kv
    calls, kk, nk, w = head.get("calls", 0), head.get("kk", 0), head.get("nk", 0), head.get("w", 0)
    behaviour_end = end + ((8 + 4 * _NP) * calls + 8 * kk + w * nk + (-(w * nk) % 4) if w else 0)
    routed = n * head.get("layers", 0) * head.get("k", 0) * head.get("rw", 0)
    routing_end = behaviour_end + routed + (-routed % 4)
    present = [name for name, bit in _FLOATS if head.get("floats", 0) & bit]
    floats_end = size = routing_end + 4 * n * len(present)
    has_topk, k = bool(head.get("floats", 0) & _TOPK), 0
    if has_topk:
        if len(record) < floats_end + 4:
            raise CodecError(f"sample {head.get('sample_id')}: record ends before its top-k section")
        (k,) = _U32.unpack_from(record, floats_end)
        size = floats_end + 4 + 8 * n * k
    if len(record) != size:
        raise CodecError(f"sample {head.get('sample_id')}: record is {len(record)} bytes, expected {size}")
    arr = np.frombuffer(record, dtype=np.uint8, offset=off)
    ints = arr[8 * n : end - off].view(_I32)
    mv, ml, vv, vl = ints[:km], ints[km : 2 * km], ints[2 * km : 2 * km + kv], ints[2 * km + kv :]
    lengths = ints[km : 2 * km].tolist(), ints[2 * km + kv :].tolist()  # few: cheaper in Python than numpy
    if sum(lengths[0]) != n or sum(lengths[1]) != n or min((*lengths[0], *lengths[1], 0)) < 0:
        raise CodecError(f"sample {head['sample_id']}: run lengths do not add up to {n} tokens")
    behaviour = _decode_behaviour(record, end, n, calls, kk, nk, w, head["sample_id"]) if w else None
    routing = None
    if head.get("rw"):
        ids = np.frombuffer(record, dtype=_I16 if head["rw"] == 2 else np.uint8, count=routed // head["rw"],
                            offset=behaviour_end)
        routing = ids.reshape(n, head["layers"], head["k"]).astype(np.int16 if head["rw"] == 2 else np.uint8)
    floats = {name: np.frombuffer(record, dtype=_F32, count=n, offset=routing_end + 4 * n * i).astype(np.float32)
              for i, name in enumerate(present)}
    topk = {}
    if has_topk:
        at = floats_end + 4
        ids = np.frombuffer(record, dtype=_I32, count=n * k, offset=at)
        lps = np.frombuffer(record, dtype=_F32, count=n * k, offset=at + 4 * n * k)
        topk = {"teacher_topk_ids": ids.reshape(n, k).astype(np.int32),
                "teacher_topk_logprobs": lps.reshape(n, k).astype(np.float32)}
    return Sample(
        token_ids=arr[: 4 * n].view(_I32).astype(np.int32),  # astype copies: writable, native order
        loss_mask=np.repeat(mv, ml).astype(np.int32),
        logprobs=arr[4 * n : 8 * n].view(_F32).astype(np.float32),
        versions=np.repeat(vv, vl).astype(np.int32),
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
        behaviour=behaviour,
        routing=routing,
        **floats,
        **topk,
    )


def _decode_behaviour(record: bytes | memoryview, off: int, n: int, calls: int, kk: int, nk: int, w: int,
                      sample_id: str) -> Behaviour:
    """The behaviour section of a format-3 record, starting at ``off`` (sizes already checked)."""
    arr = np.frombuffer(record, dtype=np.uint8, offset=off)
    ints = arr[: 8 * calls].view(_I32)
    params = arr[8 * calls : (8 + 4 * _NP) * calls].view(_F32).reshape(calls, _NP)
    at = (8 + 4 * _NP) * calls
    runs = arr[at : at + 8 * kk].view(_I32)
    cl = runs[kk:].tolist()
    if sum(cl) != n or min(cl, default=0) < 0:
        raise CodecError(f"sample {sample_id}: kept-count runs do not add up to {n} tokens")
    ids = arr[at + 8 * kk : at + 8 * kk + w * nk].view(_U16 if w == 2 else _I32)
    try:
        return Behaviour(ints[:calls].astype(np.int32), ints[calls:].astype(np.int32), params.astype(np.float32),
                         np.repeat(runs[:kk], cl).astype(np.int32), ids.astype(np.int32))
    except ValueError as e:
        raise CodecError(f"sample {sample_id}: {e}") from e

# ---------------------------------------------------------------------------- batches

@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a batch's samples are built.

    Each decoded sample is a handful of new container objects (the Sample, its info and timings
    dicts, the header dict); every 700 such allocations the collector runs and walks the young
    generation, so a 256-sample batch would pay a few collections for objects that hold no cycles.
    (This mattered most when batches decoded to per-token lists: four 2,048-element lists per
    sample.) Paused, the batch is walked once by the next collection. Re-enables only what it
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


def decode_batch(data: bytes | memoryview) -> Batch:
    """Decode a batch (samples as in ``decode_sample``)."""
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
            samples.append(decode_sample(view[off : off + rlen]))
            off += rlen
    if off != len(view):
        raise CodecError(f"{len(view) - off} trailing bytes after batch")
    return Batch(batch_id=head["batch_id"], samples=samples, learner_version=head["learner_version"],
                 info=head.get("info", {}))
