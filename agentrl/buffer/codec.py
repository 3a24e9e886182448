"""Binary encoding of samples and batches: the bytes in the buffer's log and on the learner's wire.

A sample without sections is a format-2 record: a fixed struct header, the sample's strings, a
small JSON object for the rare fields, then raw little-endian arrays::

    "ARS2" | n, km, kv (u32) | min_version (i32) | reward (f64) | truncated (u8) | 3 pad
           | byte lengths of sample_id, episode_id, group_id, env, JSON (u32 x 5)
    | utf-8 strings | JSON {"error", "error_kind", "info", "timings"}, non-default keys only (may be empty)
    | pad to 4 | token ids (i32 x n) | logprobs (f32 x n)
    | loss mask runs: values (i32 x km), lengths (i32 x km) | version runs: values, lengths (kv each)

The loss mask and the per-token policy versions travel run-length encoded because both are long
runs in practice (prompt / generated turns, one version per weight update). A 2,048-token sample is
about 8 bytes per token plus a few dozen bytes of header; no number ever travels as JSON text.

A sample with sections (:mod:`agentrl.buffer.sections`) is a format-6 record: the format-2 record
with a section table, and the sections' bodies after the arrays::

    "ARS6" | the format-2 header | S, the number of sections (u32)
    | strings | JSON | pad to 4
    | section table: S x (name length, offset, length) (u32 x 3) | names (utf-8) | pad to 4
    | the format-2 arrays | each section's body, in table order, padded to 4

Offsets count from the record's first byte; each body starts where the one before it ends, padded
to 4 (the first where the arrays end), and the record ends with the last. A body is what its
section's ``encode`` gave; the codec knows no section's layout. A reader skips a section whose name
no registered section has (written by a newer version or a plug-in it does not import): the sample
reads without it.

The per-token fields are numpy arrays (``Sample`` guarantees int32/float32): their bytes are
written as they are (on a little-endian machine, without conversion), and the mask and version
runs come from one comparison each. Decoding gives writable arrays (one copy out of the record,
so a learner may turn them into tensors in place with ``torch.from_numpy``).

A batch is ``MAGIC | u32 header length | JSON header | (u32 length | sample record)*``.

Invariants: ``decode_sample(encode_sample(s))`` equals ``s`` field by field and section by section,
except that logprobs round-trip through float32 (rounded to nearest, as a C ``(float)`` cast; a
finite value beyond float32 becomes +-inf) and a loss mask of bools or floats comes back as 0/1
ints (both done by ``Sample`` itself). Formats 2 and 6 are written; records of formats 1, 3, 4 and 5
(logs written before the section table) are still read (:mod:`agentrl.buffer.legacy`). Decoding
rejects what it does not know with :class:`CodecError` instead of guessing.
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

from agentrl.buffer import legacy
from agentrl.buffer.arrays import pack_ints, runs
from agentrl.buffer.sample import Sample
from agentrl.buffer.sections.base import sections as registered
from agentrl.errors import AgentrlError

FORMAT_VERSION = 6
BATCH_MAGIC = b"ARB1"
RECORD_MAGIC = b"ARS2"  # a sample without sections
SECTIONS_MAGIC = b"ARS6"  # a format-2 record with a section table
_U32 = struct.Struct("<I")
_BATCH_HEAD = struct.Struct("<4sI")
_HEAD = struct.Struct("<4sIIIidB3xIIIII")
_HEAD6 = struct.Struct("<4sIIIidB3xIIIIII")
_ENTRY = struct.Struct("<III")  # a section's name length, offset, length
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_HEADS = {RECORD_MAGIC: (2, _HEAD), SECTIONS_MAGIC: (6, _HEAD6)}


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


def _le(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` as little-endian ``dtype`` (the same array when it already is: no copy on this side
    of a little-endian machine; ``tobytes`` then copies once, contiguous or not)."""
    return a.astype(dtype, copy=False)


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
    mv, ml = runs(sample.loss_mask)
    vv, vl = runs(sample.versions)
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
    pad = b" " * (-len(strings) % 4)  # keeps the arrays 4-byte aligned (the fixed headers: 52 and 56 bytes)
    fixed = (n, km, kv, min_version, float(sample.reward), bool(sample.truncated),
             len(sid), len(eid), len(gid), len(env), len(rb))
    arrays = (_le(sample.token_ids, _I32).tobytes(), _le(sample.logprobs, _F32).tobytes(),
              pack_ints(mv + ml + vv + vl))
    if sample.sections:
        count, table, tail = _section_table(sample, _HEAD6.size + len(strings) + len(pad), 8 * (n + km + kv))
        head, version = _HEAD6.pack(SECTIONS_MAGIC, *fixed, count) + strings + pad + table, 6
    else:
        head, tail, version = _HEAD.pack(RECORD_MAGIC, *fixed) + strings + pad, (), 2
    record = b"".join((prefix, head, *arrays, *tail))
    meta = {"v": version, "n": n, "km": km, "kv": kv, "min_version": min_version,
            "sample_id": sample.sample_id, "episode_id": sample.episode_id, "group_id": sample.group_id,
            "env": sample.env, "reward": float(sample.reward), "truncated": bool(sample.truncated),
            "error": sample.error, "error_kind": sample.error_kind, "info": sample.info,
            "timings": sample.timings}
    return record, meta


def _section_table(sample: Sample, at: int, arrays: int) -> tuple[int, bytes, tuple[bytes, ...]]:
    """The sample's sections, in registration order: how many, their table (which starts at ``at``
    and is followed by ``arrays`` bytes of arrays) and their bodies with their pads."""
    present = [(name, section.encode(sample.sections[name])) for name, section in registered().items()
               if name in sample.sections]
    names = [name.encode() for name, _ in present]
    size = _ENTRY.size * len(present) + sum(map(len, names))
    offset = at + size + (-size % 4) + arrays
    entries, tail = [], []
    for name, (_, body) in zip(names, present, strict=True):
        entries.append(_ENTRY.pack(len(name), offset, len(body)))
        tail += [body, b"\0" * (-len(body) % 4)]
        offset += len(body) + (-len(body) % 4)
    table = b"".join((*entries, *names, b"\0" * (-size % 4)))
    return len(present), table, tuple(tail)


def _parse(record: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """The header of a record of any format, and the offset of its arrays."""
    magic = bytes(record[:4])
    if magic not in _HEADS and magic not in legacy.HEADS:
        try:
            return legacy.json_header(record)
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CodecError(f"unreadable sample header: {e}") from e
    version, st = _HEADS[magic] if magic in _HEADS else legacy.HEADS[magic]
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
            "timings": rare.get("timings", {}), "sections": []}
    if len(strings) != len(raw) - lrare:  # non-ASCII ids: slice by bytes, not characters
        sb = raw[: lsid + leid + lgid + lenv]
        head.update(sample_id=sb[:a].decode(), episode_id=sb[a:b].decode(), group_id=sb[b:c].decode(),
                    env=sb[c:].decode())
    used = off + lsid + leid + lgid + lenv + lrare
    used += -used % 4
    if version == 6:
        return head, _parse_table(record, used, extra[0], head)
    if version != 2:
        try:
            legacy.check_header(version, extra, head)
        except ValueError as e:
            raise CodecError(f"sample {head['sample_id']}: {e}") from e
    return head, used


def _parse_table(record: bytes | memoryview, at: int, count: int, head: dict[str, Any]) -> int:
    """Read a format-6 section table at ``at`` into ``head["table"]`` (name, offset, length) and
    ``head["sections"]`` (names); returns the offset of the arrays."""
    try:
        entries = [_ENTRY.unpack_from(record, at + _ENTRY.size * i) for i in range(count)]
        names_at = at + _ENTRY.size * count
        size = sum(e[0] for e in entries)
        raw = bytes(record[names_at : names_at + size])
        if len(raw) != size:
            raise ValueError("the table's names are cut")
        names, cut = [], 0
        for length, _, _ in entries:
            names.append(raw[cut : cut + length].decode())
            cut += length
        if len(set(names)) != len(names):
            raise ValueError(f"a name twice in {names}")
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CodecError(f"sample {head['sample_id']}: unreadable section table: {e}") from e
    head["table"] = [(name, off, length) for name, (_, off, length) in zip(names, entries, strict=True)]
    head["sections"] = names
    end = names_at + size
    return end + (-end % 4)


def read_header(record: bytes | memoryview) -> dict[str, Any]:
    """The header of a sample record (ids, reward, flags, info, timings, sizes, min_version, the
    names of its sections), without decoding its arrays."""
    return _parse(record)[0]


def decode_sample(record: bytes | memoryview) -> Sample:
    """Decode a record into a Sample whose per-token fields are writable numpy arrays (int32 token
    ids, mask and versions, float32 logprobs; each section's as its ``decode`` gives them): what a
    learner turns into tensors without a copy (``torch.from_numpy``)."""
    head, off = _parse(record)
    n, km, kv, sid = head["n"], head["km"], head["kv"], head["sample_id"]
    end = off + 8 * n + 8 * km + 8 * kv
    parts, size = _sections_of(record, head, end)
    if len(record) != size:
        raise CodecError(f"sample {sid}: record is {len(record)} bytes, expected {size}")
    arr = np.frombuffer(record, dtype=np.uint8, offset=off)
    ints = arr[8 * n : end - off].view(_I32)
    mv, ml, vv, vl = ints[:km], ints[km : 2 * km], ints[2 * km : 2 * km + kv], ints[2 * km + kv :]
    lengths = ints[km : 2 * km].tolist(), ints[2 * km + kv :].tolist()  # few: cheaper in Python than numpy
    if sum(lengths[0]) != n or sum(lengths[1]) != n or min((*lengths[0], *lengths[1], 0)) < 0:
        raise CodecError(f"sample {sid}: run lengths do not add up to {n} tokens")
    sections: dict[str, dict[str, Any]] = {}
    known = registered()
    for name, data in parts:
        if name in known:  # an unknown name is skipped: a newer writer's or a plug-in's section
            try:
                sections[name] = known[name].decode(data, n)
            except (ValueError, struct.error) as e:
                raise CodecError(f"sample {sid}: section {name}: {e}") from e
    try:
        return Sample(
            token_ids=arr[: 4 * n].view(_I32).astype(np.int32),  # astype copies: writable, native order
            loss_mask=np.repeat(mv, ml).astype(np.int32),
            logprobs=arr[4 * n : 8 * n].view(_F32).astype(np.float32),
            versions=np.repeat(vv, vl).astype(np.int32),
            episode_id=head["episode_id"],
            group_id=head["group_id"],
            env=head["env"],
            reward=head["reward"],
            sample_id=sid,
            truncated=head["truncated"],
            error=head["error"],
            error_kind=head.get("error_kind"),
            info=head["info"],
            timings=head["timings"],
            sections=sections,
        )
    except ValueError as e:
        raise CodecError(str(e)) from e


def _sections_of(record: bytes | memoryview, head: dict[str, Any],
                 end: int) -> tuple[list[tuple[str, memoryview]], int]:
    """The (name, bytes) of a record's sections, whose arrays end at ``end``, and the record's size."""
    if head["v"] == 6:
        view, parts = memoryview(record), []
        for name, off, length in head["table"]:
            if off != end:
                raise CodecError(f"sample {head['sample_id']}: section {name} at offset {off}, "
                                 f"expected {end}")
            parts.append((name, view[off : off + length]))
            end = off + length + (-length % 4)
        return parts, end
    if head["v"] in (3, 4, 5):
        try:
            return legacy.sections(head, record, end)
        except (ValueError, struct.error) as e:
            raise CodecError(f"sample {head['sample_id']}: {e}") from e
    return [], end

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
