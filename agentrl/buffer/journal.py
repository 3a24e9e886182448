"""The buffer's journal: its operations as records of the write-ahead log, and back on restart.

Role: :class:`~agentrl.buffer.core.Buffer` keeps the state (pending samples, groups, leases,
counters); the journal knows how each of its operations is written to the
:class:`~agentrl.buffer.log.Log` (a put of samples, the ack of a batch, a round of drops, a
compaction snapshot) and reads a recovered log back as typed records (:data:`Record`) that the
buffer applies in order. The file format (framing, CRCs, torn tails, atomic rewrite) is the log's.

Invariants:
- One operation, one write: a put's samples, an ack, a round of drops are each one ``append``,
  durable per the sync policy when the call returns, so the buffer counts them only after.
- Replay yields records in log order and never raises on bad bytes: a record that does not
  decode, or that its consumer cannot apply, is counted in :attr:`Recovery.unreadable`, logged,
  and skipped; the records around it still apply.
- A compacted log starts with one STATE record (a :class:`Snapshot`: the counters and memory of ids the
  pending samples do not carry) followed by a PUT per pending sample; the rewrite is atomic.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.buffer.codec import CodecError, read_header
from agentrl.buffer.log import Kind, Log, SyncPolicy, frame, frame_header
from agentrl.buffer.units import ARRIVAL, Entry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Put:
    """A sample entered the buffer (its entry keeps the PUT payload: arrival time + record)."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class Acked:
    """A leased batch was consumed by the learner at ``learner_version``."""

    batch_id: str
    sample_ids: list[str]
    learner_version: int
    staleness: dict[int, int]  # staleness -> how many of the batch's samples had it


@dataclass(frozen=True, slots=True)
class Dropped:
    """Samples left the buffer unconsumed, for ``reason``."""

    reason: str
    sample_ids: list[str]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What compaction carries over that the pending samples' PUTs do not: the counters, and the
    memory of finished samples, batches and groups (each list oldest first)."""

    produced: int  # samples no longer pending (the pending ones count again from their PUTs)
    consumed: int
    dropped: dict[str, int]  # reason -> samples
    staleness: dict[int, int]  # staleness -> consumed samples that had it
    closed: list[str]  # group ids no longer taking members
    terminal: list[tuple[str, str]]  # (sample id, "consumed" | "dropped:<reason>")
    acked: list[str]  # batch ids
    group_episodes: list[tuple[str, list[str]]]  # (group id, the episode ids it sent)

    def to_json(self) -> bytes:
        return json.dumps({"produced": self.produced, "consumed": self.consumed, "dropped": self.dropped,
                           "staleness": {str(k): v for k, v in self.staleness.items()},
                           "closed": self.closed, "terminal": self.terminal, "acked": self.acked,
                           "group_episodes": self.group_episodes}).encode()

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Snapshot:
        staleness = {int(k): v for k, v in d["staleness"].items()}
        return cls(d["produced"], d["consumed"], dict(d["dropped"]), staleness, list(d["closed"]),
                   [(i, s) for i, s in d["terminal"]], list(d["acked"]),
                   # logs compacted before group_episodes was kept have none
                   [(g, list(episodes)) for g, episodes in d.get("group_episodes", [])])


Record = Put | Acked | Dropped | Snapshot


@dataclass
class Recovery:
    """What reading a log back found, besides its records."""

    unreadable: int = 0  # records that checked out but did not decode or apply
    orphan_ids: int = 0  # ids named by an ack or drop whose PUT was lost (counted nowhere)
    corrupt_regions: int = 0
    skipped_bytes: int = 0
    truncated_bytes: int = 0


def decode_record(kind: Kind, payload: bytes) -> Record:
    """A log record as what it says (a put, an ack, a drop or the compacted state)."""
    if kind == Kind.PUT:
        (arrival,) = ARRIVAL.unpack_from(payload, 0)
        head = read_header(memoryview(payload)[ARRIVAL.size :])
        return Put(Entry(head["sample_id"], head["episode_id"], head["group_id"], head["min_version"],
                         arrival, payload))
    d = json.loads(payload)
    if kind == Kind.STATE:
        return Snapshot.from_json(d)
    if kind == Kind.ACK:
        return Acked(d["batch_id"], d["sample_ids"], d["learner_version"],
                     {int(k): v for k, v in d["staleness"].items()})
    return Dropped(d["reason"], d["sample_ids"])


class Journal:
    """The buffer's durable history in ``directory`` (see module doc)."""

    def __init__(self, directory: str | os.PathLike[str], sync: SyncPolicy) -> None:
        self._log = Log(directory, sync)

    @property
    def path(self) -> Path:
        return self._log.path

    @property
    def size(self) -> int:
        return self._log.size

    def replay(self, apply: Callable[[Record], int]) -> Recovery:
        """Read the log back, calling ``apply`` on each record in order, then open it for appending.

        ``apply`` returns how many of the sample ids the record names are unknown to it (see
        :attr:`Recovery.orphan_ids`).
        """
        rec = Recovery()
        for kind, payload in self._log.recover():
            try:
                rec.orphan_ids += apply(decode_record(kind, payload))
            except (CodecError, ValueError, KeyError, TypeError) as e:
                rec.unreadable += 1
                log.warning("buffer: skipping an unreadable %s record in %s: %s", kind.name, self.path, e)
        scan = self._log.report
        rec.corrupt_regions, rec.skipped_bytes, rec.truncated_bytes = (
            scan.corrupt_regions, scan.skipped_bytes, scan.truncated_bytes)
        return rec

    def put(self, entries: list[Entry]) -> None:
        # Header and payload are passed apart so a large sample is not copied once more to frame it.
        records: list[bytes] = []
        for e in entries:
            records += (frame_header(Kind.PUT, e.payload), e.payload)
        self._log.append(records)

    def ack(self, acked: Acked) -> None:
        payload = json.dumps({"batch_id": acked.batch_id, "sample_ids": acked.sample_ids,
                              "learner_version": acked.learner_version,
                              "staleness": {str(k): v for k, v in acked.staleness.items()}})
        self._log.append([frame(Kind.ACK, payload.encode())])

    def drop(self, drops: Iterable[Dropped]) -> None:
        records = [json.dumps({"reason": d.reason, "sample_ids": d.sample_ids}).encode() for d in drops]
        self._log.append([frame(Kind.DROP, r) for r in records])

    def compact(self, snapshot: Snapshot, pending: Iterable[Entry]) -> None:
        """Replace the log with ``snapshot`` and the PUTs of the ``pending`` samples, atomically."""
        records = [frame(Kind.STATE, snapshot.to_json())]
        records += [frame(Kind.PUT, e.payload) for e in pending]
        self._log.rewrite(records)

    def close(self) -> None:
        self._log.close()
