"""The task frontier: how far the rollout has read its task stream, and which groups are open.

A restarted serve must neither skip tasks nor train any twice. The frontier is an append-only
file in the run directory (``rollout_frontier.jsonl``): one line when a group starts (its id, its
task's index in the stream and the task) and one when all its episodes are in the buffer. On
restart the orchestrator reads it back, skips the ``cursor`` tasks earlier runs drew, and resumes
every group still open: the buffer says how many of that group's episodes it already took
(:meth:`agentrl.buffer.Buffer.group_progress`), and only the missing ones are played again, under
the same group id. A group the buffer already holds whole is closed without playing anything.

Lines are flushed as they are written, so a ``kill -9`` of serve loses none (a line torn by a
power loss is skipped on reading). Tasks are stored as JSON, so a resumed group plays the task it
started with even when the stream is not deterministic. The file is rewritten compactly (cursor
and open groups only) each time it is opened.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from agentrl.buffer.disk import append_record

log = logging.getLogger(__name__)


class TaskFrontier:
    """Cursor and open groups, durable in ``path``."""

    def __init__(self, path: Path, fresh: bool = False, stream: str = "") -> None:
        """``fresh``: forget what an earlier run of the directory left (a run that does not resume).
        ``stream`` names the task stream (environment and its config): a file written for another
        one is not resumed."""
        self.path = path
        self.stream = stream
        self.cursor = 0  # tasks drawn from the stream so far, by every run of this directory
        self.open: dict[str, tuple[int, dict[str, Any]]] = {}  # group id -> (task index, task)
        if path.exists() and not fresh:
            self._read()
        self._rewrite()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _read(self) -> None:
        torn = 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if "cursor" in rec:
                if rec.get("stream", "") != self.stream:
                    log.warning("task frontier %s was kept for another task stream (%r, not %r): starting "
                                "the stream afresh", self.path, rec.get("stream", ""), self.stream)
                    return
                self.cursor = max(self.cursor, int(rec["cursor"]))
            if "start" in rec:
                self.open[rec["start"]] = (int(rec["index"]), rec["task"])
                self.cursor = max(self.cursor, int(rec["index"]) + 1)
            elif "end" in rec:
                self.open.pop(rec["end"], None)
        if torn:
            log.warning("task frontier %s: skipped %d torn line(s)", self.path, torn)
        if self.cursor or self.open:
            log.info(
                "task frontier: %d task(s) drawn before, %d group(s) to resume", self.cursor, len(self.open)
            )

    def _rewrite(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"cursor": self.cursor, "stream": self.stream}) + "\n")
            for gid, (index, task) in self.open.items():
                f.write(json.dumps({"start": gid, "index": index, "task": task}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def _write(self, rec: dict[str, Any]) -> None:
        # Whole lines or none: a lost start only lets a restart draw its task again, a lost end
        # makes a restart ask the buffer, which answers that the group is complete.
        append_record(self._fd, rec, f"task frontier {self.path}")

    def start(self, group_id: str, index: int, task: dict[str, Any]) -> None:
        """A group starts on the stream's task ``index`` (a fresh one, not a resumed one)."""
        self.open[group_id] = (index, task)
        self.cursor = max(self.cursor, index + 1)
        self._write({"start": group_id, "index": index, "task": task})

    def finish(self, group_id: str) -> None:
        """Every episode of the group is in the buffer."""
        if self.open.pop(group_id, None) is not None:
            self._write({"end": group_id})

    def close(self) -> None:
        os.close(self._fd)
