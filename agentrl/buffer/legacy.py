"""Reading sample records of the formats written before the section table (formats 1, 3, 4 and 5).

Role: logs written by earlier versions still read. Each of these formats carried the built-in
sections at fixed places (sizes in a longer fixed header, bodies after the core arrays in a fixed
order); this module knows those places, and hands each section's bytes, in the section's own
layout, to the codec, which decodes them with the registered section like any other. Nothing here
is written any more, and nothing here grows: a new section only exists in format 6.

Formats (each a format-2 record, :mod:`agentrl.buffer.codec`, with more u32 in its header):

- 1: ``u32 header length | JSON header`` then the format-2 arrays (no sections).
- 3 ("ARS3"): calls C, kept-count runs kk, kept ids nk, kept-id width w; after the arrays, the
  behaviour's body (its section layout without its 16-byte head) and a pad to 4.
- 4 ("ARS4"): format 3's four (w 0: no behaviour) and layers L, k, expert-id width rw; after the
  behaviour, the routing's ids and a pad to 4.
- 5 ("ARS5"): format 4's seven (rw 0: no routing) and a bitmask of float sections (1: the
  teacher's logprobs, 2: token rewards, 4: the teacher's top-k), in bit order after the routing.

Invariants: a header whose sizes do not fit its format is a ValueError naming them (the codec adds
the sample id and makes it a CodecError); the sections returned cover the record up to the size
returned, which the codec compares with the record's length before decoding any of them.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from agentrl.buffer.behaviour import PARAMS

HEADS = {b"ARS3": (3, struct.Struct("<4sIIIidB3xIIIIIIIII")),  # magic -> format, fixed header
         b"ARS4": (4, struct.Struct("<4sIIIidB3xIIIIIIIIIIII")),
         b"ARS5": (5, struct.Struct("<4sIIIidB3xIIIIIIIIIIIII"))}
_EXTRA = ("calls", "kk", "nk", "w", "layers", "k", "rw", "floats")
_FLOATS = (("teacher_logprobs", 1), ("token_rewards", 2))  # section, its bit in the mask
_TOPK = 4
_U32, _U32X3, _U32X4 = struct.Struct("<I"), struct.Struct("<III"), struct.Struct("<IIII")


def json_header(record: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """A format-1 record's header and the offset of its arrays."""
    (hlen,) = _U32.unpack_from(record, 0)
    head = json.loads(bytes(record[4 : 4 + hlen]))
    if not isinstance(head, dict) or head.get("v") != 1:
        raise ValueError(f"unknown sample record format "
                         f"{head.get('v') if isinstance(head, dict) else head!r}")
    return head, 4 + hlen


def check_header(version: int, extra: list[int], head: dict[str, Any]) -> None:
    """Add a format 3-5 header's section sizes to ``head``; ValueError when they do not fit."""
    head.update(dict.fromkeys(_EXTRA, 0))
    head.update(zip(_EXTRA, extra, strict=False))
    w, rw = head["w"], head["rw"]
    if w not in ((2, 4) if version == 3 else (0, 2, 4)) or (w == 0 and head["calls"] + head["kk"]):
        raise ValueError(f"kept ids of {w} bytes")
    if rw not in ((1, 2) if version == 4 else (0, 1, 2)) or (rw == 0 and head["layers"] + head["k"]):
        raise ValueError(f"expert ids of {rw} bytes")
    known = sum(bit for _, bit in _FLOATS) | _TOPK
    if version == 5 and (head["floats"] == 0 or head["floats"] & ~known):
        raise ValueError(f"unknown float sections {head['floats']:#x}")


def sections(head: dict[str, Any], record: bytes | memoryview,
             at: int) -> tuple[list[tuple[str, memoryview]], int]:
    """The sections of a format 3-5 record whose arrays end at ``at``, as (name, the section's
    bytes in its own layout), and where the record should end."""
    view, n, out = memoryview(record), head["n"], []
    if head["w"]:
        size = (8 + 4 * len(PARAMS)) * head["calls"] + 8 * head["kk"] + head["w"] * head["nk"]
        out.append(("behaviour", memoryview(_U32X4.pack(head["calls"], head["kk"], head["nk"], head["w"])
                                            + view[at : at + size])))
        at += size + (-size % 4)
    if head["rw"]:
        size = n * head["layers"] * head["k"] * head["rw"]
        routing_head = _U32X3.pack(head["layers"], head["k"], head["rw"])
        out.append(("routing", memoryview(routing_head + view[at : at + size])))
        at += size + (-size % 4)
    for name, bit in _FLOATS:
        if head["floats"] & bit:
            out.append((name, view[at : at + 4 * n]))
            at += 4 * n
    if head["floats"] & _TOPK:
        if len(view) < at + 4:
            raise ValueError("record ends before its top-k section")
        (k,) = _U32.unpack_from(view, at)
        out.append(("teacher_topk", view[at : at + 4 + 8 * n * k]))
        at += 4 + 8 * n * k
    return out, at
