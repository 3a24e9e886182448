"""The session log's writer: records reach their files off the event loop, in the order they were
recorded, and all of them once a flush or a close returns."""

from __future__ import annotations

import asyncio
import json
import threading

from agentrl.router.session_log import SessionLog


def test_lines_are_written_in_order_per_file_once_a_flush_returns(tmp_path) -> None:
    writer = SessionLog()
    paths = [tmp_path / f"s{i}.jsonl" for i in range(3)]

    async def main() -> None:
        for n in range(600):
            writer.append(paths[n % 3], json.dumps({"n": n}))
        await writer.flush()

    asyncio.run(main())
    for i, path in enumerate(paths):
        assert [json.loads(x)["n"] for x in path.read_text().splitlines()] == list(range(i, 600, 3))
    writer.close()


def test_the_writes_happen_on_the_writer_thread_not_the_callers(tmp_path, monkeypatch) -> None:
    import agentrl.router.session_log as session_log

    threads: list[str] = []
    real = session_log._append

    def spy(path, line) -> None:
        threads.append(threading.current_thread().name)
        real(path, line)

    monkeypatch.setattr(session_log, "_append", spy)
    writer = SessionLog()
    writer.append(tmp_path / "s.jsonl", "{}")
    writer.close()
    assert threads == ["session-log"]
    assert (tmp_path / "s.jsonl").read_text() == "{}\n"


def test_close_writes_what_was_queued_and_later_lines_are_still_written(tmp_path) -> None:
    writer = SessionLog()
    path = tmp_path / "s.jsonl"
    for n in range(50):
        writer.append(path, str(n))
    writer.close()
    writer.close()  # idempotent
    writer.append(path, "50")  # after close: written at once, after the rest
    assert path.read_text().splitlines() == [str(n) for n in range(51)]


def test_a_full_disk_loses_the_line_whole_and_the_next_follows_a_whole_line(tmp_path, monkeypatch) -> None:
    """A write that runs out of space part way leaves no torn bytes behind (they would glue the next
    record onto half a line); the lost line is logged, the router goes on."""
    import errno
    import os

    import agentrl.buffer.disk as disk

    path = tmp_path / "s.jsonl"
    writer = SessionLog()
    real_write, full = os.write, {"on": False, "took": 0}

    def write(fd: int, data) -> int:  # a disk with room for 5 more bytes: a short write, then ENOSPC
        if full["on"]:
            if full["took"]:
                full["on"], full["took"] = False, 0
                raise OSError(errno.ENOSPC, "No space left on device")
            full["took"] = real_write(fd, bytes(data[:5]))
            return full["took"]
        return real_write(fd, data)

    monkeypatch.setattr(disk.os, "write", write)

    async def main() -> None:
        writer.append(path, json.dumps({"n": 1}))
        await writer.flush()
        full["on"] = True
        writer.append(path, json.dumps({"n": 2, "pad": "x" * 100}))
        await writer.flush()
        writer.append(path, json.dumps({"n": 3}))
        await writer.flush()

    asyncio.run(main())
    writer.close()
    assert [json.loads(x)["n"] for x in path.read_text().splitlines()] == [1, 3]
