"""A sample's per-token float sections (teacher logprobs, token rewards, the teacher's top-k): the
fields' invariants and their bytes in the buffer's records, alone, together, and beside a behaviour
and a routing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from agentrl.buffer.behaviour import Behaviour
from agentrl.buffer.codec import CodecError, decode_sample, encode_sample, read_header
from agentrl.buffer.sample import Sample, routing_array

TOKENS = np.array([1, 2, 3, 4, 3, 5, 6, 3, 2, 4], dtype=np.int32)
MASK = [0, 0, 0, 1, 1, 1, 0, 1, 1, 1]
TEACHER = np.array([np.nan] * 3 + [-0.25, -1.5, -0.125] + [np.nan] + [-2.0, -0.5, -3.25], dtype=np.float32)


def sample(teacher=TEACHER, behaviour=None, routing=None) -> Sample:
    return Sample(
        TOKENS,
        MASK,
        [-0.5 * m for m in MASK],
        [0 if m else -1 for m in MASK],
        episode_id="e",
        group_id="g",
        env="t",
        reward=1.0,
        teacher_logprobs=teacher,
        behaviour=behaviour,
        routing=routing,
        info={"teacher": {"name": "tiny-agent", "version": 0}},
    )


def test_teacher_logprobs_cover_every_token_as_float32():
    s = sample(TEACHER.astype(np.float64))
    assert s.teacher_logprobs.dtype == np.float32
    with pytest.raises(ValueError, match="teacher logprobs must be 1-D over its 10 tokens"):
        sample(TEACHER[:-1])


def test_a_sample_with_teacher_logprobs_round_trips_through_a_record_with_a_teacher_section():
    s = sample()
    record, meta = encode_sample(s)
    assert record[:4] == b"ARS6" and read_header(record)["v"] == meta["v"] == 6
    back = decode_sample(record)
    assert back == s and back.teacher_logprobs.flags.writeable
    assert np.isnan(back.teacher_logprobs[:3]).all() and back.info["teacher"] == {
        "name": "tiny-agent",
        "version": 0,
    }
    plain, _ = encode_sample(sample(None))  # 4 bytes a token, and 32 bytes of section table beyond format 2
    assert plain[:4] == b"ARS2" and len(record) - len(plain) == 32 + 4 * len(TOKENS)


def test_teacher_logprobs_travel_with_a_behaviour_and_a_routing():
    b = Behaviour.from_calls(
        10, [(3, 3, {"temperature": 0.7}, None), (7, 3, {"temperature": 1.5}, None)], TOKENS
    )
    r = routing_array(10, 2, 2, False)
    r[2:9] = 3
    for s in (sample(behaviour=b), sample(routing=r), sample(behaviour=b, routing=r)):
        back = decode_sample(encode_sample(s)[0])
        assert back == s and back.behaviour == s.behaviour
        assert (back.routing is None) == (s.routing is None)


def test_a_cut_teacher_section_is_a_codec_error_and_an_unknown_one_is_skipped():
    record, _ = encode_sample(sample())
    with pytest.raises(CodecError, match="expected"):
        decode_sample(record[:-4])
    bad = bytearray(record)
    at = bytes(bad).index(b"teacher_logprobs")
    bad[at : at + 16] = b"teacher_entropy_"  # a section this reader does not know
    assert read_header(bytes(bad))["sections"] == ["teacher_entropy_"]
    back = decode_sample(bytes(bad))
    assert back.teacher_logprobs is None and back == replace(sample(None), sample_id=back.sample_id)


def test_token_rewards_travel_beside_the_teacher_logprobs_in_the_same_format():
    rewards = np.full(10, np.nan, dtype=np.float32)
    rewards[[5, 9]] = [0.5, -1.0]  # a process scorer's reward of each turn, on its last token
    both = replace(sample(), token_rewards=rewards)
    alone = replace(sample(None), token_rewards=rewards)
    plain, _ = encode_sample(sample(None))
    for s, table in ((both, 4 + 2 * 12 + 32), (alone, 4 + 12 + 16)):  # a count, entries, names padded
        record, meta = encode_sample(s)
        assert meta["v"] == 6 and len(record) - len(plain) == table + 4 * len(TOKENS) * len(s.sections)
        back = decode_sample(record)
        assert back == s and back.token_rewards[[5, 9]].tolist() == [0.5, -1.0]
        assert (back.teacher_logprobs is None) == (s.teacher_logprobs is None)


def _topk(k: int = 3) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((10, k), -1, dtype=np.int32)
    lps = np.full((10, k), np.nan, dtype=np.float32)
    generated = np.flatnonzero(MASK)
    ids[generated] = np.arange(k) + 100 * np.arange(len(generated))[:, None]
    lps[generated] = -0.25 * (np.arange(k) + 1)
    return ids, lps


def test_the_teachers_top_k_round_trips_beside_the_other_sections():
    ids, lps = _topk()
    plain, _ = encode_sample(sample(None))
    for s in (replace(sample(), teacher_topk_ids=ids, teacher_topk_logprobs=lps),
              replace(sample(None), teacher_topk_ids=ids, teacher_topk_logprobs=lps,
                      behaviour=Behaviour.from_calls(10, [(3, 3, {"temperature": 0.7}, None)], TOKENS))):
        record, meta = encode_sample(s)
        assert meta["v"] == 6 and "teacher_topk" in read_header(record)["sections"]
        back = decode_sample(record)
        assert (
            back == s
            and back.teacher_topk_ids.tolist() == ids.tolist()
            and back.teacher_topk_ids.flags.writeable
        )
    alone, _ = encode_sample(replace(sample(None), teacher_topk_ids=ids, teacher_topk_logprobs=lps))
    assert len(alone) - len(plain) == 28 + 4 + 8 * 3 * len(TOKENS)  # table, k, then 8 bytes a token per rank


def test_the_teachers_top_k_fields_go_together_over_every_token():
    ids, lps = _topk()
    with pytest.raises(ValueError, match="go together"):
        replace(sample(), teacher_topk_ids=ids)
    with pytest.raises(ValueError, match=r"\[10 tokens, k\]"):
        replace(sample(), teacher_topk_ids=ids[:-1], teacher_topk_logprobs=lps[:-1])
    record, _ = encode_sample(replace(sample(), teacher_topk_ids=ids, teacher_topk_logprobs=lps))
    for cut in (4, 8 * 3 * 10 + 4 + 2):  # a logprob short; the section's k itself cut
        with pytest.raises(CodecError):
            decode_sample(record[:-cut])
