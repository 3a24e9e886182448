"""A small keep-alive HTTP/1.1 client for the router's hot path: one JSON POST to an engine.

Every completion makes one such call (token-in generate), so its cost is the router's cost:
aiohttp's client took about 150 us of CPU per call here, this one about 40 us. It does only what
that call needs: POST with a Content-Length body, a response with Content-Length or chunked
encoding, connections kept alive and reused per engine (no limit on their number; idle ones are
dropped before the server's keep-alive timeout). Streaming and control calls stay on aiohttp.

Failures: :class:`UpstreamClosed` when the connection was refused, reset or closed before the
response was complete (the engine is gone or going); :class:`UpstreamProtocolError` for an answer
that is not HTTP. A reused keep-alive connection that the server had closed just before the call
is retried once on a fresh connection, before any response byte was read.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from urllib.parse import urlsplit

IDLE_S = 4.0  # uvicorn (vLLM) closes idle keep-alive connections after 5 s


class UpstreamClosed(ConnectionError):
    """The connection was refused, reset or closed before a whole response arrived."""


class UpstreamProtocolError(Exception):
    """The engine answered something that is not a well-formed HTTP/1.1 response."""


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter, float]


class Upstream:
    def __init__(self, idle_s: float = IDLE_S) -> None:
        self.idle_s = idle_s
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._addr: dict[str, tuple[str, int, str]] = {}

    def _address(self, base_url: str) -> tuple[str, int, str]:
        a = self._addr.get(base_url)
        if a is None:
            u = urlsplit(base_url)
            if u.scheme != "http" or not u.hostname:
                raise ValueError(f"only plain http:// engine URLs are supported here, not {base_url!r}")
            a = self._addr[base_url] = (u.hostname, u.port or 80, u.path.rstrip("/"))
        return a

    async def post(self, base_url: str, path: str, payload: bytes, timeout_s: float) -> tuple[int, bytes]:
        """POST ``payload`` (JSON) to ``base_url + path``: (status, body). Bounded by ``timeout_s``."""
        host, port, prefix = self._address(base_url)
        head = (f"POST {prefix}{path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode("latin-1")
        async with asyncio.timeout(timeout_s):
            conn = self._take((host, port))
            if conn is not None:
                try:
                    return await self._exchange((host, port), conn, head + payload)
                except _StaleConnection:
                    pass  # closed by the server while idle: nothing was read, send it once more
            reader, writer = await self._open(host, port)
            try:
                return await self._exchange((host, port), (reader, writer, 0.0), head + payload)
            except _StaleConnection as e:
                raise UpstreamClosed(f"{host}:{port} closed the connection without answering") from e

    async def _open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_connection(host, port, limit=2**24)
        except OSError as e:
            raise UpstreamClosed(f"cannot connect to {host}:{port}: {e}") from e

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        q = self._idle.get(key)
        now = time.monotonic()
        while q:
            reader, writer, t = q.pop()
            if now - t < self.idle_s and not reader.at_eof() and not writer.is_closing():
                return reader, writer, t
            writer.close()
        return None

    async def _exchange(self, key: tuple[str, int], conn: _Conn, request: bytes) -> tuple[int, bytes]:
        reader, writer, _ = conn
        done = False
        got_bytes = False
        try:
            writer.write(request)
            try:
                status_line = await reader.readuntil(b"\r\n")
            except asyncio.IncompleteReadError as e:
                if not e.partial:
                    raise _StaleConnection() from e
                raise
            got_bytes = True
            parts = status_line.split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
                raise UpstreamProtocolError(f"not an HTTP response: {status_line[:80]!r}")
            status = int(parts[1])
            length = -1
            chunked = False
            keep = parts[0] == b"HTTP/1.1"
            while True:
                line = await reader.readuntil(b"\r\n")
                if line == b"\r\n":
                    break
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                elif name == b"connection":
                    keep = value.strip().lower() != b"close"
            if chunked:
                body = await _read_chunked(reader)
            elif length >= 0:
                body = await reader.readexactly(length)
            else:
                body = await reader.read()  # until the server closes
                keep = False
            done = True
        except (ConnectionError, asyncio.IncompleteReadError, BrokenPipeError) as e:
            if isinstance(e, ConnectionResetError | BrokenPipeError) and not got_bytes:
                raise _StaleConnection() from e
            raise UpstreamClosed(f"{key[0]}:{key[1]} closed the connection mid-response: {type(e).__name__}") from e
        except ValueError as e:
            raise UpstreamProtocolError(f"malformed HTTP response from {key[0]}:{key[1]}: {e}") from e
        finally:
            if done and keep:
                self._idle.setdefault(key, deque()).append((reader, writer, time.monotonic()))
            else:
                writer.close()  # cancelled, failed or not reusable: never hand back a half-read connection
        return status, body

    async def close(self) -> None:
        for q in self._idle.values():
            while q:
                q.pop()[1].close()
        self._idle.clear()


class _StaleConnection(Exception):
    """A connection that failed before any response byte (reused: retry; fresh: the engine is gone)."""


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                pass
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)
