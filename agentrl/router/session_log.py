"""The session log's writer: appends each call record's JSON line to its session's file off the
event loop.

A router records every call of every session as it completes (``<sessions_dir>/<id>.jsonl``); at a
thousand concurrent calls an ``open``/``write``/``close`` on the event loop per call holds up every
other call for as long as the disk takes. Here one writer thread does the appends.

Invariants: lines are written in the order they were appended (one FIFO queue, one thread), so a
session's file lists its calls in order; each line is appended and its file closed before the next
is taken (a crash loses at most the lines still queued, never a part of a line already written,
the same durability as appending on the loop without fsync); :meth:`SessionLog.flush` returns once
every line appended before it is on disk (the router awaits it when a session ends, so a finished
episode's log is complete when its summary is returned); :meth:`SessionLog.close` flushes and stops
the thread, and an at-exit hook does the same for a log nobody closed.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import weakref
from pathlib import Path

from agentrl.buffer.disk import append_line

log = logging.getLogger(__name__)

_STOP = None  # the queue item that ends the writer thread


class SessionLog:
    def __init__(self) -> None:
        # a record to append, a flush marker (set once everything queued before it is written), or _STOP
        self._queue: queue.Queue[tuple[Path, str] | threading.Event | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one thread started, however many first appends race
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))

    def append(self, path: Path, line: str) -> None:
        """Queue ``line`` (one JSON record, no newline) for the end of ``path``; returns at once."""
        if self._closed:  # after close (shutdown): written here, in order after everything queued
            _append(path, line)
            return
        if self._thread is None:
            self._start()
        self._queue.put((path, line))

    async def flush(self) -> None:
        """Wait (off the loop) until every line appended so far is written: a marker behind them, so
        lines other sessions append meanwhile do not hold it up."""
        if self._thread is not None and not self._closed:
            written = threading.Event()
            self._queue.put(written)
            await asyncio.to_thread(written.wait)

    def close(self) -> None:
        """Write what is queued and stop the writer thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            while (
                not self._queue.empty()
            ):  # a flush marker queued behind the stop: nothing is left to wait for
                item = self._queue.get_nowait()
                if isinstance(item, threading.Event):
                    item.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="session-log", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, threading.Event):
                    item.set()
                    continue
                path, line = item
                try:
                    _append(path, line)
                except OSError as e:  # a vanished disk loses this record, not the router
                    log.error("could not append a call record to %s: %s", path, e)
            finally:
                self._queue.task_done()


def _append(path: Path, line: str) -> None:
    """The line whole or not at all: on a full disk it is logged and lost, and no torn part of it is
    left for the next line to follow (a session file stays one JSON record a line)."""
    append_line(path, line)


def _close_at_exit(ref: weakref.ref[SessionLog]) -> None:
    writer = ref()
    if writer is not None:
        writer.close()
