"""The behaviour's section: how each generated token's distribution was formed (a
:class:`~agentrl.buffer.behaviour.Behaviour`: each call's sampling settings, each token's kept set),
so the learner can replay it (:mod:`agentrl.learner.replay`). A sample without one was sampled at
temperature 1 from the whole vocabulary.

Invariants: the behaviour covers exactly the sample's tokens (its own invariants are checked by
``Behaviour``). Bytes: calls C, kept-count runs kk, kept ids nk and the kept-id width w (u32 x 4;
w is 2 when every id fits in a u16, else 4), then the call starts and lengths (i32 x C each), the
call settings (f32 x 7C, ``behaviour.PARAMS``), the kept-count runs (values, lengths: i32 x kk
each) and the kept ids (u16 or i32 x nk). Kept counts are long runs (0 on prompts, top_k on most
tokens of a top-k call), so a call costs 36 bytes and a truncated token about ``w * top_k``.
"""

from __future__ import annotations

import struct

import numpy as np

from agentrl.buffer.arrays import pack_ints, runs
from agentrl.buffer.behaviour import PARAMS, Behaviour
from agentrl.buffer.sections.base import F32, I32, Section, Values, register

_HEAD = struct.Struct("<IIII")
_U16 = np.dtype("<u2")
_NP = len(PARAMS)


@register
class BehaviourSection(Section):
    name = "behaviour"
    fields = ("behaviour",)

    def check(self, values: Values, tokens: int) -> Values:
        b = values["behaviour"]
        if b.kept_counts.shape != (tokens,):
            raise ValueError(f"behaviour covers {b.kept_counts.shape[0]} tokens of {tokens}")
        return values

    def encode(self, values: Values) -> bytes:
        b: Behaviour = values["behaviour"]
        cv, cl = runs(b.kept_counts)
        nk = b.kept_ids.shape[0]
        wide = bool(nk) and (int(b.kept_ids.max()) > 0xFFFF or int(b.kept_ids.min()) < 0)
        ids = b.kept_ids.astype(I32, copy=False) if wide else b.kept_ids.astype(_U16)
        spans = (b.starts.astype(I32, copy=False).tobytes(), b.lengths.astype(I32, copy=False).tobytes())
        return b"".join((_HEAD.pack(b.calls, len(cv), nk, 4 if wide else 2), *spans,
                         b.params.astype(F32, copy=False).tobytes(), pack_ints(cv + cl), ids.tobytes()))

    def decode(self, data: memoryview, tokens: int) -> Values:
        calls, kk, nk, w = _HEAD.unpack_from(data, 0)
        if w not in (2, 4):
            raise ValueError(f"kept ids of {w} bytes")
        if len(data) != _HEAD.size + (8 + 4 * _NP) * calls + 8 * kk + w * nk:
            raise ValueError(f"{len(data)} bytes for {calls} calls, {kk} kept-count runs and {nk} kept ids")
        arr = np.frombuffer(data, dtype=np.uint8, offset=_HEAD.size)
        ints = arr[: 8 * calls].view(I32)
        params = arr[8 * calls : (8 + 4 * _NP) * calls].view(F32).reshape(calls, _NP)
        at = (8 + 4 * _NP) * calls
        kept_runs = arr[at : at + 8 * kk].view(I32)
        lengths = kept_runs[kk:].tolist()
        if sum(lengths) != tokens or min(lengths, default=0) < 0:
            raise ValueError(f"kept-count runs do not add up to {tokens} tokens")
        ids = arr[at + 8 * kk : at + 8 * kk + w * nk].view(_U16 if w == 2 else I32)
        counts = np.repeat(kept_runs[:kk], lengths).astype(np.int32)
        return {"behaviour": Behaviour(ints[:calls].astype(np.int32), ints[calls:].astype(np.int32),
                                       params.astype(np.float32), counts, ids.astype(np.int32))}

    def to_json(self, field: str, value: Behaviour) -> object:
        return value.to_dict()
