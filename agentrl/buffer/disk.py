"""The run directory's disk: a guard that says when it is (nearly) full, and appends that a full
disk cannot tear.

Role: serve writes its buffer log, episode log, metrics, task frontier, sessions and received
weights under the run directory. :class:`DiskGuard` is what admission control asks before the
rollout starts an episode: the disk is *full* once a write failed with ENOSPC (or EDQUOT), or once
the free space on the run directory's filesystem fell under ``buffer.min_free_mb``. It polls the
free space (``statvfs``, at most once a second) and clears itself when the space is back, so serve
resumes with nobody's help. It logs one warning when the disk fills and one when it frees.

Invariants:
- :func:`append_whole` leaves a file as it was or with the whole text appended, never a torn
  line: a write that fails part way is cut back to where it began.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError

log = logging.getLogger(__name__)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(AgentrlError, OSError):
    """A write under the run directory failed for want of space (ENOSPC or EDQUOT); what was
    written before is whole."""


def is_no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in NO_SPACE


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` to the file open at ``fd`` (O_APPEND), all or nothing: a write that fails
    part way (a full disk) is truncated back to the file's size before it and re-raised."""
    start = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        if view.nbytes != len(data):
            try:
                os.ftruncate(fd, start)
            except OSError:
                log.exception("could not cut %d torn bytes off a file (fd %d)", len(data) - view.nbytes, fd)
        if is_no_space(e):
            raise DiskFull(e.errno, f"no space left to write {len(data)} bytes: {e.strerror}") from e
        raise


def append_line(path: Path, line: str, guard: DiskGuard | None = None) -> bool:
    """Append one line to ``path`` whole; on a full disk, log it, tell ``guard`` and return False
    (the line is not written: the caller's record of it lives elsewhere, or it is a metric)."""
    data = (line if line.endswith("\n") else line + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            append_whole(fd, data)
        finally:
            os.close(fd)
    except DiskFull as e:
        if guard is not None:
            guard.no_space(f"writing {path.name}: {e.strerror}")
        else:
            log.warning("disk full: %s not appended to (%s)", path, e.strerror)
        return False
    return True


def append_record(fd: int, record: dict[str, Any], what: str) -> bool:
    """Append ``record`` as one JSON line to the file open at ``fd`` (O_APPEND), whole or not at
    all; on a full disk, log that ``what`` lost a line and return False (a state file whose lines
    are each a change: a lost line is a change a restart does not see, which its reader allows)."""
    try:
        append_whole(fd, (json.dumps(record, default=str) + "\n").encode())
    except DiskFull as e:
        log.warning("%s: a line not written (%s)", what, e.strerror)
        return False
    return True


class DiskGuard:
    """Whether the filesystem of ``path`` has room for serve to take new work (see module doc)."""

    def __init__(self, path: str | os.PathLike[str], min_free_mb: float, poll_s: float = 1.0) -> None:
        self.path = Path(path)
        self.min_free_bytes = int(min_free_mb * (1 << 20))
        self.poll_s = poll_s
        self.reason: str | None = None
        self.free_bytes: int | None = None
        self.times_full = 0  # times the disk filled
        self._enospc = False
        self._checked = 0.0
        self._since = 0.0

    @property
    def full(self) -> bool:
        """True while serve must admit nothing new; polls the free space (at most every ``poll_s``)."""
        if time.monotonic() - self._checked >= self.poll_s:
            self.check()
        return self.reason is not None

    def check(self) -> None:
        self._checked = time.monotonic()
        try:
            st = os.statvfs(self.path)
        except OSError as e:  # the folder went away: say so, do not guess
            self._set(f"cannot read the free space of {self.path}: {e.strerror}")
            return
        self.free_bytes = st.f_bavail * st.f_frsize
        if self.free_bytes < self.min_free_bytes:
            self._set(f"{self.free_bytes / (1 << 20):.1f} MB free on the run directory's filesystem "
                      f"({self.path}), under buffer.min_free_mb = {self.min_free_bytes / (1 << 20):g}"
                      + (" (a write failed with ENOSPC)" if self._enospc else ""))
        elif self.reason is not None and not (self._enospc and self.free_bytes < 2 * self.min_free_bytes):
            # After an ENOSPC, wait for twice the threshold: the write that failed needs room too.
            log.warning("disk space is back (%.1f MB free on %s after %.0f s full): admitting new "
                        "episodes again", self.free_bytes / (1 << 20), self.path,
                        time.monotonic() - self._since)
            self.reason, self._enospc = None, False

    def no_space(self, what: str) -> None:
        """A write failed with ENOSPC: full until the free space is back."""
        self._enospc = True
        self._set(f"no space left on the run directory's filesystem ({self.path}): {what}")
        self._checked = time.monotonic()

    def _set(self, reason: str) -> None:
        if self.reason is None:
            self._since = time.monotonic()
            self.times_full += 1
            log.warning("disk full: %s; admitting no new episodes until space frees (finished "
                        "episodes wait in memory, nothing is dropped)", reason)
        self.reason = reason

    def stats(self) -> dict[str, object]:
        self.full  # noqa: B018 (polls the free space)
        return {"disk_full": int(self.reason is not None), "disk_full_reason": self.reason,
                "disk_free_mb": None if self.free_bytes is None else round(self.free_bytes / (1 << 20), 1),
                "disk_full_times": self.times_full}
