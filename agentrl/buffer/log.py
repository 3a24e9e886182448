"""The buffer's write-ahead log: one append-only file of length-prefixed, CRC-checked records.

Record layout: ``MAGIC(4) | kind(u8) | length(u32) | crc32(u32) | payload``, where the CRC covers
kind, length and payload, so a corrupt length is caught too. The buffer writes each logical
operation (a put, an ack, a set of drops) as one ``write`` call, then flushes to the OS (enough to
survive kill -9 of the process) or also fsyncs (enough to survive losing the machine), per config.

Invariants:
- A record is either wholly valid or skipped on reading: scanning resynchronises on the next valid
  record after a corrupt region and logs a warning; a torn or corrupt tail is cut off (with a
  warning) so that later appends follow a valid record. Reading never raises on bad bytes.
- An append that fails part way (a full disk: :class:`~agentrl.buffer.disk.DiskFull`) is cut back
  to the record boundary where it began, so the next append never follows garbage.
- ``rewrite`` (compaction) is atomic: the new file is written and fsynced beside the old one, then
  renamed over it, then the directory is fsynced. A crash leaves either the old or the new log;
  a rewrite that fails (a full disk) removes its new file and leaves the old log.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Literal

from agentrl.buffer.disk import DiskFull, append_whole, is_no_space

log = logging.getLogger(__name__)

MAGIC = b"ARL1"
_HEAD = struct.Struct("<4sBII")
HEADER_BYTES = _HEAD.size
MAX_RECORD_BYTES = 1 << 30

SyncPolicy = Literal["fsync", "flush"]


class Kind(IntEnum):
    PUT = 1  # payload: f64 arrival time (unix s) + sample record
    ACK = 2  # payload: JSON {batch_id, sample_ids, learner_version, staleness}
    DROP = 3  # payload: JSON {reason, sample_ids}
    STATE = 4  # payload: JSON counters carried over by compaction; first record of a compacted log


def frame_header(kind: Kind, payload: bytes) -> bytes:
    """The header that frames ``payload`` as a record (write the two back to back)."""
    crc = zlib.crc32(payload, zlib.crc32(bytes((kind,)) + struct.pack("<I", len(payload))))
    return _HEAD.pack(MAGIC, kind, len(payload), crc)


def frame(kind: Kind, payload: bytes) -> bytes:
    return frame_header(kind, payload) + payload


@dataclass
class ScanReport:
    records: int = 0
    corrupt_regions: int = 0
    skipped_bytes: int = 0
    truncated_bytes: int = 0
    valid_end: int = 0


def _parse_at(buf: mmap.mmap | bytes, pos: int, size: int) -> tuple[int, bytes] | None:
    """The (kind, payload) of a valid record at ``pos``, or None."""
    if pos + HEADER_BYTES > size:
        return None
    magic, kind, length, crc = _HEAD.unpack_from(buf, pos)
    if magic != MAGIC or length > MAX_RECORD_BYTES or pos + HEADER_BYTES + length > size:
        return None
    if kind not in Kind._value2member_map_:
        return None
    payload = buf[pos + HEADER_BYTES : pos + HEADER_BYTES + length]
    if zlib.crc32(payload, zlib.crc32(bytes((kind,)) + struct.pack("<I", length))) != crc:
        return None
    return kind, payload


def scan(path: Path, report: ScanReport) -> Iterator[tuple[Kind, bytes]]:
    """Yield every valid record of the file in order, skipping corrupt regions (see module doc)."""
    size = path.stat().st_size if path.exists() else 0
    if size == 0:
        return
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0
        while pos < size:
            rec = _parse_at(buf, pos, size)
            if rec is not None:
                kind, payload = rec
                pos += HEADER_BYTES + len(payload)
                report.records += 1
                report.valid_end = pos
                yield Kind(kind), payload
                continue
            # Corrupt or torn: look for the next record that checks out.
            nxt = buf.find(MAGIC, pos + 1)
            while nxt != -1 and _parse_at(buf, nxt, size) is None:
                nxt = buf.find(MAGIC, nxt + 1)
            if nxt == -1:
                report.truncated_bytes = size - pos
                log.warning("buffer log %s: corrupt or truncated tail of %d bytes at offset %d; "
                            "discarding it", path, size - pos, pos)
                return
            report.corrupt_regions += 1
            report.skipped_bytes += nxt - pos
            log.warning("buffer log %s: skipped %d corrupt bytes at offset %d", path, nxt - pos, pos)
            pos = nxt


class Log:
    """An append-only record file in ``directory``; thread-safe appends."""

    FILENAME = "buffer.log"

    def __init__(self, directory: str | os.PathLike[str], sync: SyncPolicy = "fsync") -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / self.FILENAME
        self.sync = sync
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.report = ScanReport()

    def recover(self) -> Iterator[tuple[Kind, bytes]]:
        """Yield the valid records, then cut any bad tail and open the file for appending."""
        tmp = self.path.with_suffix(".compact")
        if tmp.exists():  # a compaction that died before its rename; the old log is intact
            tmp.unlink()
        self.report = ScanReport()
        yield from scan(self.path, self.report)
        if self.report.truncated_bytes:
            with self.path.open("r+b") as f:
                f.truncate(self.report.valid_end)
                os.fsync(f.fileno())
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size if self._fd is not None else 0

    def append(self, records: Iterable[bytes]) -> None:
        """Write framed records (or their headers and payloads, in order) as one write; durable
        per ``sync`` when this returns."""
        data = b"".join(records)
        if not data:
            return
        with self._lock:
            if self._fd is None:
                raise RuntimeError(f"buffer log {self.path} is closed")
            # A write torn by a full disk is cut back: the next append starts on a record boundary.
            append_whole(self._fd, data)
            if self.sync == "fsync":
                os.fdatasync(self._fd)

    def rewrite(self, records: Iterable[bytes]) -> None:
        """Atomically replace the whole log with ``records`` (compaction)."""
        tmp = self.path.with_suffix(".compact")
        with self._lock:
            try:
                with tmp.open("wb") as f:
                    for r in records:
                        f.write(r)
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException as e:  # a full disk: the old log stays, and the space goes back
                tmp.unlink(missing_ok=True)
                if is_no_space(e):
                    raise DiskFull(e.errno, f"no space left to compact {self.path}: {e.strerror}") from e
                raise
            os.replace(tmp, self.path)
            if self._fd is not None:
                os.close(self._fd)
            self._open()

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
