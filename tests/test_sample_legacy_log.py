"""A buffer log written by the record formats before the section table (ARS2 to ARS5) still reads.

``tests/fixtures/buffer_log_ars5.bin`` is the ``buffer.log`` a durable :class:`Buffer` wrote at
commit 617d762 (the last one to write formats 2 to 5) when :func:`legacy_samples` were put into it:
a plain sample (format 2), behaviours with u16 and int32 kept ids (format 3), uint8 and int16
routings with and without a behaviour (format 4), and teacher logprobs, token rewards and the
teacher's top-k alone and beside the others (format 5). The test rebuilds the same samples here and
checks every field of what the current code reads back, record by record and through a restarted
buffer.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np

from agentrl.buffer.behaviour import Behaviour
from agentrl.buffer.codec import decode_sample
from agentrl.buffer.config import BufferConfig
from agentrl.buffer.core import Buffer
from agentrl.buffer.log import Kind, ScanReport, scan
from agentrl.buffer.sample import Sample
from agentrl.buffer.units import ARRIVAL

FIXTURE = Path(__file__).parent / "fixtures" / "buffer_log_ars5.bin"
TOKENS = np.array([1, 2, 3, 4, 3, 5, 6, 3, 2, 4], dtype=np.int32)
MASK = [0, 0, 0, 1, 1, 1, 0, 1, 1, 1]
N = len(TOKENS)


def _sample(tag: str, reward: float, **sections) -> Sample:
    versions = [0 if m else -1 for m in MASK]
    logprobs = [-0.25 * (i + 1) * m for i, m in enumerate(MASK)]
    return Sample(TOKENS, MASK, logprobs, versions, episode_id=f"e-{tag}", group_id=f"g-{tag}", env="legacy",
                  reward=reward, sample_id=f"s-{tag}", truncated=tag == "plain",
                  info={"turns": 2, "tag": tag}, timings={"episode_s": 1.5}, **sections)


def _behaviour(wide: bool = False) -> Behaviour:
    tokens = TOKENS.copy()
    if wide:
        tokens[4] = 70_000
    kept = [[4, 1, 2], [70_000 if wide else 3, 0, 9], [5, 6, 7]]
    calls = [(3, 3, {"temperature": 0.7, "top_k": 3}, kept), (7, 3, {"top_p": 0.9}, None)]
    return Behaviour.from_calls(N, calls, tokens)


def _routing(wide: bool) -> np.ndarray:
    r = np.full((N, 2, 2), -1 if wide else 255, dtype=np.int16 if wide else np.uint8)
    r[2:9] = np.arange(7 * 4).reshape(7, 2, 2) * (11 if wide else 1)
    return r


def _floats(seed: float) -> np.ndarray:
    a = np.full(N, np.nan, dtype=np.float32)
    a[np.flatnonzero(MASK)] = seed * (np.arange(6) + 1)
    return a


def _topk(k: int) -> dict[str, np.ndarray]:
    ids = np.full((N, k), -1, dtype=np.int32)
    lps = np.full((N, k), np.nan, dtype=np.float32)
    generated = np.flatnonzero(MASK)
    ids[generated] = np.arange(k) + 100 * np.arange(len(generated))[:, None]
    lps[generated] = -0.5 * (np.arange(k) + 1)
    return {"teacher_topk_ids": ids, "teacher_topk_logprobs": lps}


def legacy_samples() -> list[Sample]:
    """The samples in the fixture, in the order they were put."""
    tokens_wide = TOKENS.copy()
    tokens_wide[4] = 70_000
    wide = _sample("behaviour-wide", 0.5, behaviour=_behaviour(wide=True))
    wide.token_ids = tokens_wide
    return [
        _sample("plain", 1.0),
        _sample("behaviour", 0.0, behaviour=_behaviour()),
        wide,
        _sample("routing-u8", 1.0, routing=_routing(False)),
        _sample("routing-i16-behaviour", 0.0, routing=_routing(True), behaviour=_behaviour()),
        _sample("teacher", 1.0, teacher_logprobs=_floats(-0.125)),
        _sample("rewards", 0.0, token_rewards=_floats(0.5)),
        _sample("topk", 1.0, **_topk(3)),
        _sample("everything", 0.5, behaviour=_behaviour(), routing=_routing(False),
                teacher_logprobs=_floats(-0.25), token_rewards=_floats(-1.0), **_topk(2)),
    ]


def _put_records() -> list[bytes]:
    report = ScanReport()
    records = [payload[ARRIVAL.size:] for kind, payload in scan(FIXTURE, report) if kind == Kind.PUT]
    assert report.corrupt_regions == 0
    return records


def test_every_record_of_a_format_5_log_reads_back_field_by_field():
    records = _put_records()
    assert [bytes(r[:4]) for r in records] == [b"ARS2", b"ARS3", b"ARS3", b"ARS4", b"ARS4", b"ARS5", b"ARS5",
                                              b"ARS5", b"ARS5"]
    for record, want in zip(records, legacy_samples(), strict=True):
        got = decode_sample(record)
        assert got == want, want.sample_id
        for name in ("behaviour", "routing", "teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs",
                     "token_rewards"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), (want.sample_id, name)
            if isinstance(b, np.ndarray):
                assert a.dtype == b.dtype and a.shape == b.shape and a.flags.writeable, (want.sample_id, name)
                assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), (want.sample_id, name)
            elif b is not None:
                assert a == b, (want.sample_id, name)


def test_a_buffer_restarted_on_a_format_5_log_serves_its_samples(tmp_path: Path):
    (tmp_path / "buf").mkdir()
    shutil.copy(FIXTURE, tmp_path / "buf" / "buffer.log")
    want = {s.sample_id: s for s in legacy_samples()}

    async def read() -> dict[str, Sample]:
        buf = Buffer(BufferConfig(path=str(tmp_path / "buf"), batch_size=len(want), max_staleness=4))
        try:
            batch = await buf.get_batch(0)
            assert batch is not None
            return {s.sample_id: s for s in batch.samples}
        finally:
            buf.close()

    got = asyncio.run(read())
    assert got.keys() == want.keys()
    for sid, s in want.items():
        assert got[sid] == s, sid
