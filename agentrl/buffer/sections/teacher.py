"""On-policy distillation's sections: a teacher's logprob of each sampled token, and its top-k.

``teacher_logprobs``: float32 [tokens], the teacher's log p(token_t | tokens_<t) where it scored
(NaN elsewhere: the prompt); a sample no teacher saw has none. ``teacher_topk_ids`` and
``teacher_topk_logprobs`` (with ``scoring.teacher.top_k``): the teacher's top-k token ids at each
position it scored, [tokens, k] int32 in the teacher's order (-1 where it did not score), and their
logprobs, [tokens, k] float32 (NaN there). ``info["teacher"]`` names the teacher and version
(:mod:`agentrl.scoring.teacher` fills them). Both give the learner's micro-batch a tensor
(:class:`agentrl.learner.microbatch.MicroBatch`, NaN where no teacher scored): the logprobs
[S, T-1] and the top-k logprobs [S, T-1, k]; the top-k ids go into the packed row.

Invariants: both top-k fields are set together or not at all, with the same shape. Bytes: the
logprobs are f32 x tokens; the top-k is k (u32), the ids (i32 x tokens*k) and the logprobs
(f32 x tokens*k), C order: 8k bytes a token.
"""

from __future__ import annotations

import struct

import numpy as np

from agentrl.buffer.arrays import float32_array, int32_array
from agentrl.buffer.sections.base import F32, I32, Section, TokenFloats, Values, register

_K = struct.Struct("<I")


@register
class TeacherLogprobs(TokenFloats):
    name = "teacher_logprobs"
    fields = ("teacher_logprobs",)
    fill = float("nan")


@register
class TeacherTopK(Section):
    name = "teacher_topk"
    fields = ("teacher_topk_ids", "teacher_topk_logprobs")
    fill = float("nan")

    def tensor(self, values: Values) -> np.ndarray:
        return values["teacher_topk_logprobs"]

    def check(self, values: Values, tokens: int) -> Values:
        ids, lps = values.get("teacher_topk_ids"), values.get("teacher_topk_logprobs")
        if ids is None or lps is None:
            raise ValueError("the teacher's top-k ids and logprobs go together")
        ids, lps = int32_array(ids, "teacher_topk_ids"), float32_array(lps)
        if not (ids.ndim == 2 and ids.shape[0] == tokens and lps.shape == ids.shape):
            raise ValueError(f"the teacher's top-k ids and logprobs must both be [{tokens} tokens, k], not "
                             f"{ids.shape} and {lps.shape}")
        return {"teacher_topk_ids": ids, "teacher_topk_logprobs": lps}

    def encode(self, values: Values) -> bytes:
        ids, lps = values["teacher_topk_ids"], values["teacher_topk_logprobs"]
        return b"".join((_K.pack(ids.shape[1]), ids.astype(I32, copy=False).tobytes(),
                         lps.astype(F32, copy=False).tobytes()))

    def decode(self, data: memoryview, tokens: int) -> Values:
        (k,) = _K.unpack_from(data, 0)
        if len(data) != 4 + 8 * tokens * k:
            raise ValueError(f"{len(data)} bytes for a top-{k} over {tokens} tokens")
        ids = np.frombuffer(data, dtype=I32, count=tokens * k, offset=4)
        lps = np.frombuffer(data, dtype=F32, count=tokens * k, offset=4 + 4 * tokens * k)
        return {"teacher_topk_ids": ids.reshape(tokens, k).astype(np.int32),
                "teacher_topk_logprobs": lps.reshape(tokens, k).astype(np.float32)}
