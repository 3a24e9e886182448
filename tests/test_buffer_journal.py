"""The buffer's journal: each operation written is read back as the same typed record, in order."""

from __future__ import annotations

from pathlib import Path

from agentrl.buffer import Sample
from agentrl.buffer.codec import encode_with_prefix
from agentrl.buffer.journal import Acked, Dropped, Journal, Put, Record, Snapshot
from agentrl.buffer.log import Kind, Log, frame
from agentrl.buffer.units import ARRIVAL, Entry


def entry(i: int, arrival: float = 5.0) -> Entry:
    s = Sample(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 2, 2],
               episode_id=f"e{i}", group_id=f"g{i}", env="t", reward=1.0, sample_id=f"s{i}")
    payload, head = encode_with_prefix(s, prefix=ARRIVAL.pack(arrival))
    return Entry(s.sample_id, s.episode_id, s.group_id, head["min_version"], arrival, payload)


def read_back(path: Path) -> tuple[list[Record], Journal]:
    records: list[Record] = []
    journal = Journal(path, "flush")
    recovery = journal.replay(lambda r: records.append(r) or 0)
    assert recovery.unreadable == 0
    return records, journal


def test_puts_acks_and_drops_are_read_back_as_written(tmp_path: Path) -> None:
    j = Journal(tmp_path, "flush")
    j.replay(lambda r: 0)
    j.put([entry(0), entry(1)])
    j.ack(Acked("b1", ["s0"], 3, {1: 1}))
    j.drop([Dropped("stale", ["s1"])])
    j.close()
    records, j = read_back(tmp_path)
    j.close()
    assert records == [Put(entry(0)), Put(entry(1)), Acked("b1", ["s0"], 3, {1: 1}), Dropped("stale", ["s1"])]
    assert records[0].entry.min_version == 2


def test_a_compacted_journal_is_its_snapshot_then_the_pending_puts(tmp_path: Path) -> None:
    j = Journal(tmp_path, "flush")
    j.replay(lambda r: 0)
    j.put([entry(0), entry(1)])
    j.ack(Acked("b1", ["s0"], 3, {1: 1}))
    snap = Snapshot(produced=1, consumed=1, dropped={"stale": 0}, staleness={1: 1}, closed=["g0"],
                    terminal=[("s0", "consumed")], acked=["b1"], group_episodes=[("g0", ["e0"])])
    j.compact(snap, [entry(1)])
    j.close()
    records, j = read_back(tmp_path)
    j.close()
    assert records == [snap, Put(entry(1))]


def test_a_record_that_does_not_decode_is_counted_and_its_neighbours_apply(tmp_path: Path) -> None:
    log = Log(tmp_path, "flush")
    list(log.recover())
    log.append([frame(Kind.DROP, b"{not json"),
                frame(Kind.DROP, b'{"reason": "stale", "sample_ids": ["x"]}')])
    log.close()
    seen: list[Record] = []
    recovery = Journal(tmp_path, "flush").replay(lambda r: seen.append(r) or 1)
    assert recovery.unreadable == 1 and recovery.orphan_ids == 1
    assert seen == [Dropped("stale", ["x"])]


def test_a_snapshot_written_before_group_episodes_were_kept_reads_back(tmp_path: Path) -> None:
    import json

    old = {"produced": 3, "consumed": 2, "dropped": {"stale": 1}, "staleness": {"0": 2}, "closed": ["g"],
           "terminal": [["a", "consumed"]], "acked": ["b"]}
    log = Log(tmp_path, "flush")
    list(log.recover())
    log.append([frame(Kind.STATE, json.dumps(old).encode())])
    log.close()
    records, j = read_back(tmp_path)
    j.close()
    assert records == [Snapshot(produced=3, consumed=2, dropped={"stale": 1}, staleness={0: 2}, closed=["g"],
                                terminal=[("a", "consumed")], acked=["b"], group_episodes=[])]
    assert json.loads(records[0].to_json()) == {**old, "group_episodes": []}
