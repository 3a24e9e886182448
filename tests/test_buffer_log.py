"""The buffer's log on disk: torn and corrupt records are detected and skipped with a warning."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from agentrl.buffer import Buffer, BufferConfig, Sample
from agentrl.buffer.log import Kind, Log, frame


def sample(i: int) -> Sample:
    return Sample(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 1, 1],
                  episode_id=f"e{i}", group_id=f"g{i}", env="t", reward=1.0, sample_id=f"s{i}")


def fill(path: Path, n: int) -> Path:
    async def go() -> None:
        buf = Buffer(BufferConfig(path=str(path), batch_size=1))
        for i in range(n):
            await buf.put([sample(i)])
        buf.close()

    asyncio.run(go())
    return path / Log.FILENAME


def recovered(path: Path) -> tuple[Buffer, dict]:
    buf = Buffer(BufferConfig(path=str(path), batch_size=1))
    s = buf.stats()
    assert s["identity_holds"]
    return buf, s


@pytest.mark.parametrize("cut", [1, 7, 13, 40])
def test_a_truncated_log_tail_is_cut_with_a_warning(tmp_path: Path, cut: int,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    logfile = fill(tmp_path, 5)
    size = logfile.stat().st_size
    with logfile.open("r+b") as f:
        f.truncate(size - cut)
    with caplog.at_level(logging.WARNING):
        buf, s = recovered(tmp_path)
    assert s["pending"] == 4 and s["truncated_tail_bytes"] > 0
    assert "truncated tail" in caplog.text
    buf.close()
    # The log is valid again: appends after recovery are read back.
    fill(tmp_path, 7)
    buf, s = recovered(tmp_path)
    assert s["pending"] == 7 and s["truncated_tail_bytes"] == 0


def test_a_corrupt_record_in_the_middle_is_skipped_and_later_records_survive(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    logfile = fill(tmp_path, 5)
    data = bytearray(logfile.read_bytes())
    data[len(data) // 2] ^= 0xFF
    logfile.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        buf, s = recovered(tmp_path)
    assert s["pending"] == 4 and s["corrupt_regions_skipped"] == 1
    assert "skipped" in caplog.text
    assert buf.sample_state("s0") == "pending" and buf.sample_state("s4") == "pending"


def test_garbage_appended_to_the_log_is_not_a_crash(tmp_path: Path) -> None:
    logfile = fill(tmp_path, 3)
    with logfile.open("ab") as f:
        f.write(b"ARL1\x01\xff\xff\xff\x7fjunk" + bytes(range(256)))
    _, s = recovered(tmp_path)
    assert s["pending"] == 3 and s["truncated_tail_bytes"] > 0


def test_an_ack_whose_samples_were_lost_to_corruption_keeps_the_identity(tmp_path: Path) -> None:
    path = tmp_path / "buf"
    log = Log(path)
    list(log.recover())
    log.append(
        [frame(Kind.ACK, b'{"batch_id":"b","sample_ids":["nope"],"learner_version":1,"staleness":{}}')]
    )
    log.close()
    _, s = recovered(path)
    assert s["produced"] == 0 and s["consumed"] == 0 and s["orphan_log_ids"] == 1


def test_a_well_framed_but_unreadable_record_is_skipped_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    logfile = fill(tmp_path, 2)
    with logfile.open("ab") as f:
        f.write(frame(Kind.PUT, b"\x00" * 8 + b"not a sample record"))
        f.write(frame(Kind.DROP, b"{not json"))
    fill(tmp_path, 4)
    with caplog.at_level(logging.WARNING):
        _, s = recovered(tmp_path)
    assert s["pending"] == 4 and s["unreadable_records"] == 2
    assert "unreadable" in caplog.text
