"""Host side of the exec daemon's protocol (see execd.py): framed literal requests over one byte stream.

Invariants: every request gets a fresh id and one future; when the stream ends or breaks, every
pending future fails with SandboxError and the channel stays closed. A call that outlives its
timeout raises `ExecdTimeout` (the caller treats the sandbox as broken and replaces it). A cause
found outside the stream (its Docker host stopped answering, see hosts.py) can close it with an
error of its own (:meth:`ExecChannel.lose`), which later calls then raise.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import itertools
import logging
import struct
from collections.abc import AsyncIterator, Callable
from functools import cache
from pathlib import Path
from typing import Any

from agentrl.sandbox.types import SandboxError

log = logging.getLogger(__name__)


@cache
def execd_source() -> str:
    """The exec daemon's source, passed to ``python3 -c`` so that any image with python3 can run it."""
    return (Path(__file__).with_name("execd.py")).read_text()


class ExecdTimeout(SandboxError):
    """The exec daemon did not answer in time: it is hung or its sandbox is starved."""


class ExecChannel:
    """Talks to one exec daemon. `chunks` yields its stdout bytes; `writer` is its stdin."""

    def __init__(self, chunks: AsyncIterator[bytes], writer: asyncio.StreamWriter, name: str) -> None:
        self.name = name
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[0] = self._ready
        self._closed_reason: str | None = None
        self._error: type[SandboxError] = SandboxError  # what calls on a closed channel raise
        self._on_close: list[Callable[[str], None]] = []
        self._reader = asyncio.create_task(self._read(chunks), name=f"agent-reader-{name}")

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    def on_close(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once when the stream ends or breaks by itself (at once if it has);
        not when it is closed on purpose, by :meth:`aclose` or :meth:`lose`."""
        if self._closed_reason is not None:
            callback(self._closed_reason)
        else:
            self._on_close.append(callback)

    def lose(self, reason: str, error: type[SandboxError]) -> None:
        """Close the channel for a cause found outside it: pending and later calls raise ``error``
        with ``reason``, even where the stream had already ended for a reason that said less."""
        self._closed_reason, self._error, self._on_close = None, error, []
        self._fail(reason)
        with contextlib.suppress(Exception):
            self._writer.close()

    async def wait_ready(self, timeout: float) -> dict[str, Any]:
        """The agent's first message. Raises SandboxError when it refused to run (it could not
        protect itself from the commands it would run, see execd.py) or did not start in time."""
        try:
            msg = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            raise ExecdTimeout(f"sandbox {self.name}: agent did not start within {timeout:.0f}s") from None
        if not msg.get("ready"):
            raise SandboxError(f"sandbox {self.name}: agent refused to start: {msg.get('error')}")
        return msg

    async def call(self, op: str, wait: float | None, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its answer. Errors the agent reports come back as
        ``{"error": <exception class name>, "message": ...}`` for the caller to map."""
        if self._closed_reason is not None:
            raise self._error(f"sandbox {self.name}: {self._closed_reason}")
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        body = repr({"id": rid, "op": op, **fields}).encode()
        try:
            self._writer.write(struct.pack(">I", len(body)) + body)
            await self._writer.drain()
            return await asyncio.wait_for(asyncio.shield(fut), wait)
        except TimeoutError:
            raise ExecdTimeout(f"sandbox {self.name}: agent gave no answer to {op!r} in {wait:.1f}s"
                               ) from None
        except (ConnectionError, OSError) as e:
            self._fail(f"connection to agent lost ({e!r})")
            raise SandboxError(f"sandbox {self.name}: connection to agent lost: {e!r}") from e
        finally:
            self._pending.pop(rid, None)

    async def _read(self, chunks: AsyncIterator[bytes]) -> None:
        buf = bytearray()
        reason = "agent exited"
        try:
            async for chunk in chunks:
                buf += chunk
                while len(buf) >= 4:
                    (n,) = struct.unpack_from(">I", buf)
                    if len(buf) < 4 + n:
                        break
                    msg = ast.literal_eval(bytes(buf[4 : 4 + n]).decode())
                    del buf[: 4 + n]
                    fut = self._pending.get(msg.get("id"))
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except asyncio.CancelledError:
            reason = "channel closed"
            raise
        except Exception as e:
            reason = f"agent stream broken ({e!r})"
        finally:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        if self._closed_reason is None:
            self._closed_reason = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._error(f"sandbox {self.name}: {self._closed_reason}"))
                fut.exception()  # mark retrieved: nobody may be waiting any more
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            try:
                callback(self._closed_reason or reason)
            except Exception:
                log.exception("sandbox %s: a close callback failed", self.name)

    async def aclose(self) -> None:
        """Close our end; the agent sees EOF on stdin and exits."""
        self._on_close = []
        self._fail("channel closed")
        with contextlib.suppress(Exception):
            self._writer.close()
        self._reader.cancel()
        await asyncio.wait({self._reader}, timeout=1.0)
