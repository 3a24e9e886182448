"""MoE routing's section: the experts the engine routed each token through, so the learner can
route the same way (:mod:`agentrl.learner.routing`).

``routing``: [tokens, MoE layers, k] of uint8 expert ids (up to 255 experts; 255 marks a position
the engine did not record) or int16 (``wide``; -1 marks it). The router assembles it from each
call's capture (:mod:`agentrl.router.sessions`); a dense model's samples have none.

Bytes: layers, k and the id width (u32 x 3; 1 for uint8, 2 for int16), then the ids, C order. A
top-2 routing over 24 MoE layers costs 48 bytes a token.
"""

from __future__ import annotations

import struct

import numpy as np

from agentrl.buffer.sections.base import Section, Values, register

ROUTING_DTYPES = {np.dtype(np.uint8): 255, np.dtype(np.int16): -1}  # routing dtype -> its "not recorded" id
_HEAD = struct.Struct("<III")
_I16 = np.dtype("<i2")


def routing_array(tokens: int, layers: int, k: int, wide: bool) -> np.ndarray:
    """An all-"not recorded" routing array: uint8 ids (up to 255 experts) or int16 (``wide``)."""
    dtype = np.dtype(np.int16 if wide else np.uint8)
    return np.full((tokens, layers, k), ROUTING_DTYPES[dtype], dtype=dtype)


@register
class Routing(Section):
    name = "routing"
    fields = ("routing",)

    def check(self, values: Values, tokens: int) -> Values:
        r = values["routing"]
        if not (type(r) is np.ndarray and r.ndim == 3 and r.shape[0] == tokens and r.dtype in ROUTING_DTYPES):
            raise ValueError(f"routing must be a [tokens, layers, k] uint8 or int16 array over its {tokens} "
                             f"tokens, not {getattr(r, 'dtype', type(r))} {getattr(r, 'shape', '')}")
        return values

    def encode(self, values: Values) -> bytes:
        r = values["routing"]
        width = r.dtype.itemsize
        ids = r if width == 1 else r.astype(_I16, copy=False)
        return _HEAD.pack(r.shape[1], r.shape[2], width) + ids.tobytes()

    def decode(self, data: memoryview, tokens: int) -> Values:
        layers, k, width = _HEAD.unpack_from(data, 0)
        if width not in (1, 2):
            raise ValueError(f"expert ids of {width} bytes")
        if len(data) != _HEAD.size + tokens * layers * k * width:
            raise ValueError(f"{len(data)} bytes for a routing of {tokens} x {layers} x {k} ids "
                             f"of {width} bytes")
        ids = np.frombuffer(data, dtype=_I16 if width == 2 else np.uint8, offset=_HEAD.size)
        return {"routing": ids.reshape(tokens, layers, k).astype(np.int16 if width == 2 else np.uint8)}
