"""An MoE sample's recorded routing (the experts the engine used, per token and MoE layer): its
invariants on the sample, its bytes in the buffer, and how a session's calls assemble it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agentrl.buffer.behaviour import Behaviour
from agentrl.buffer.codec import CodecError, decode_sample, encode_sample, read_header
from agentrl.buffer.sample import Sample, routing_array

TOKENS = np.array([1, 2, 3, 4, 3, 5, 6, 3, 2, 4], dtype=np.int32)
MASK = [0, 0, 0, 1, 1, 1, 0, 1, 1, 1]


def sample(routing: np.ndarray | None, behaviour: Behaviour | None = None) -> Sample:
    return Sample(TOKENS, MASK, [-0.5 * m for m in MASK], [0 if m else -1 for m in MASK], episode_id="e",
                  group_id="g", env="t", reward=1.0, routing=routing, behaviour=behaviour)


def recorded(wide: bool = False, layers: int = 3, k: int = 2) -> np.ndarray:
    r = routing_array(len(TOKENS), layers, k, wide)
    r[2:9] = np.random.default_rng(0).integers(0, 300 if wide else 8, size=(7, layers, k))
    return r


def test_a_routing_covers_every_token_and_is_uint8_or_int16():
    assert (
        routing_array(4, 2, 2, wide=False).dtype == np.uint8 and (routing_array(4, 2, 2, False) == 255).all()
    )
    assert routing_array(4, 2, 2, wide=True).dtype == np.int16 and (routing_array(4, 2, 2, True) == -1).all()
    with pytest.raises(ValueError, match="routing must be"):
        sample(routing_array(9, 3, 2, False))  # 9 positions for 10 tokens
    with pytest.raises(ValueError, match="routing must be"):
        sample(np.zeros((10, 3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="routing must be"):
        sample(np.zeros((10, 6), dtype=np.uint8))


@pytest.mark.parametrize("wide", [False, True])
def test_a_sample_with_a_routing_round_trips_through_a_record_with_a_routing_section(wide: bool):
    s = sample(recorded(wide))
    record, meta = encode_sample(s)
    assert record[:4] == b"ARS6" and read_header(record)["v"] == meta["v"] == 6
    assert read_header(record)["sections"] == ["routing"]
    back = decode_sample(record)
    assert back == s and back.routing.dtype == s.routing.dtype and back.routing.flags.writeable
    # a byte (or two) per token, layer and expert slot, beyond the format-2 record, the section table
    # (a count, an entry, the name padded: 4 + 12 + 8 bytes) and the section's 12-byte head
    plain, _ = encode_sample(sample(None))
    width = 2 if wide else 1
    assert len(record) - len(plain) == 36 + len(TOKENS) * 3 * 2 * width + (-(len(TOKENS) * 6 * width) % 4)


def test_a_routing_and_a_behaviour_travel_together():
    b = Behaviour.from_calls(
        10, [(3, 3, {"temperature": 0.7}, None), (7, 3, {"temperature": 1.5}, None)], TOKENS
    )
    s = sample(recorded(), b)
    back = decode_sample(encode_sample(s)[0])
    assert back == s and back.behaviour == b


def test_samples_without_a_routing_have_no_routing_section():
    assert encode_sample(sample(None))[0][:4] == b"ARS2"
    b = Behaviour.from_calls(10, [(3, 3, {"temperature": 0.7}, None)], TOKENS)
    record = encode_sample(sample(None, b))[0]
    assert record[:4] == b"ARS6" and read_header(record)["sections"] == ["behaviour"]


def test_a_cut_or_inconsistent_routing_section_is_a_codec_error():
    record, _ = encode_sample(sample(recorded()))
    with pytest.raises(CodecError, match="expected"):
        decode_sample(record[:-4])
    bad = bytearray(record)
    ((_, offset, _),) = read_header(record)["table"]
    bad[offset + 8 : offset + 12] = (3).to_bytes(4, "little")  # an expert-id width of 3 bytes
    with pytest.raises(CodecError, match="expert ids of 3 bytes"):
        decode_sample(bytes(bad))


# -- a session's calls -> the sample's routing ----------------------------------------------------
def entry(positions: list[int], experts: np.ndarray) -> dict:
    """A capture as the engine hands it over (agentrl.engines.routing.agentrl_routed_experts)."""
    import base64

    return {
        "id": "x",
        "choice": 0,
        "positions": positions,
        "dtype": str(experts.dtype),
        "shape": list(experts.shape),
        "experts": base64.b64encode(np.ascontiguousarray(experts).tobytes()).decode(),
    }


E1 = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2) % 7  # call 1 computed positions 0..4
E2 = np.full((5, 2, 2), 3, dtype=np.uint8)  # call 2 found 0..2 in the prefix cache, computed 3..7


def _two_calls(tmp_path, second_version: int):
    from agentrl.router.sessions import CallRecord, Completion, Session

    first = CallRecord(
        "s",
        0,
        None,
        0,
        [1, 2, 3],
        [
            Completion(
                [4, 5, 6],
                [-0.1] * 3,
                [0] * 3,
                "stop",
                {"role": "assistant", "content": "a"},
                routing=entry([0, 1, 2, 3, 4], E1),
            )
        ],
        "engine-0",
    )
    second = CallRecord(
        "s",
        1,
        0,
        0,
        [1, 2, 3, 4, 5, 6, 7, 8],
        [
            Completion(
                [9, 10],
                [-0.2] * 2,
                [second_version] * 2,
                "stop",
                {"role": "assistant", "content": "b"},
                routing=entry([3, 4, 5, 6, 7], E2),
            )
        ],
        "engine-0",
    )
    session = Session("s", log_path=tmp_path / "s.jsonl")
    session.record(first)
    session.record(second)
    return session


def test_a_two_call_session_gives_one_sample_whose_routing_is_each_positions_latest_capture(tmp_path):
    from agentrl.router.sessions import CallRecord, Session

    (s,) = _two_calls(tmp_path, second_version=0).samples()
    assert s.routing.shape == (10, 2, 2) and s.routing.dtype == np.uint8
    assert (s.routing[:3] == E1[:3]).all() and (s.routing[3:8] == 3).all()
    assert (s.routing[8:] == 255).all()  # the last generated tokens were never fed through the model
    # the records keep it as JSON: a session read back from its log gives the same sample
    back = [CallRecord.from_dict(json.loads(x)) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    again = Session("s", records=back).samples()[0]
    assert (again.routing == s.routing).all() and (again.token_ids == s.token_ids).all()


def test_positions_a_call_took_from_the_cache_after_an_update_are_not_an_earlier_versions_experts(tmp_path):
    """An update between the calls emptied the prefix cache: what the second call found there was
    computed since, under the new weights, so the first call's experts do not stand for it."""
    (s,) = _two_calls(tmp_path, second_version=1).samples()
    assert (s.routing[:3] == 255).all()  # unrecorded: the learner routes them itself
    assert (s.routing[3:8] == 3).all() and (s.routing[8:] == 255).all()


def test_a_session_without_captures_has_no_routing():
    from agentrl.router.sessions import CallRecord, Completion, Session

    rec = CallRecord(
        "s", 0, None, 0, [1, 2], [Completion([3], [-0.1], [0], "stop", {"role": "assistant"})], "e"
    )
    assert Session("s", records=[rec]).samples()[0].routing is None


def test_a_request_computed_again_keeps_only_the_experts_of_its_new_computation():
    """The engine-side record: chunked prefill and decode steps add up; a pass that starts at a
    position already held (the request lost its KV to a preemption or an update's cache reset, and
    took positions 0..3 from the prefix cache another request filled) drops what came before."""
    import torch

    from agentrl.engines.routing import _Record

    rec = _Record()
    for positions, expert in ((range(0, 6), 1), (range(6, 10), 1), (range(10, 11), 1), (range(11, 12), 1)):
        rec.add(torch.tensor(list(positions)), torch.full((len(positions), 2, 2), expert, dtype=torch.uint8))
    assert [int(p) for ps, _ in rec.chunks for p in ps] == list(range(12))
    # re-prefill from 4
    rec.add(torch.tensor(list(range(4, 12))), torch.full((8, 2, 2), 2, dtype=torch.uint8))
    rec.add(torch.tensor([12]), torch.full((1, 2, 2), 2, dtype=torch.uint8))
    assert [int(p) for ps, _ in rec.chunks for p in ps] == list(range(4, 13))
    assert all((e == 2).all() for _, e in rec.chunks)
