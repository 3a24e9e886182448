"""A small keep-alive HTTP/1.1 client for the engine pool's hot path: one JSON POST to an engine.

Every completion makes one such call (token-in generate), so its cost is the router's cost:
aiohttp's client took about 150 us of CPU per call here, an ``asyncio.StreamReader`` client about
40 us, and this one (an ``asyncio.Protocol`` that parses the response as its bytes arrive, with no
per-line awaits) less again. It does only what that call needs: POST with a Content-Length body, a
response with Content-Length or chunked encoding, connections kept alive and reused per engine (idle
ones are dropped before the server's keep-alive timeout). HTTP/1.1 carries one request at a time per
connection, so each call in flight holds a socket: ``max_connections`` bounds them per engine (calls
beyond it wait, in order, within their timeout), for a process whose open-file limit is below the
calls it keeps in flight; unset, there is no bound. Streaming
and control calls stay on aiohttp.

Timeouts: a request's deadline joins a bucket of :data:`TICK_S`; one timer per bucket fails the
requests still waiting in it with ``TimeoutError`` (never early, at most a tick late). A timer per
request (``asyncio.timeout``) cost more CPU than the rest of the exchange's Python code, and with
thousands of calls in flight for a 120 s timeout the loop's timer heap held up to a million
cancelled handles, which it re-sorts in one go (benchmarks/agent_loops.py).

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

from agentrl.errors import AgentrlError

IDLE_S = 4.0  # uvicorn (vLLM) closes idle keep-alive connections after 5 s
MAX_HEAD = 64 * 1024
UNTIL_CLOSE = -2  # a status line and headers longer than this are not an engine's answer
TICK_S = 0.05  # the deadline buckets' width: a timeout fires at most this late


class UpstreamClosed(AgentrlError, ConnectionError):
    """The connection was refused, reset or closed before a whole response arrived."""


class UpstreamProtocolError(AgentrlError):
    """The engine answered something that is not a well-formed HTTP/1.1 response."""


class _StaleConnection(AgentrlError):
    """A connection that failed before any response byte (reused: retry; fresh: the engine is gone)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_used = 0.0
        self._buf = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.bucket: set[_Connection] | None = None  # the deadline bucket it waits in (Upstream._wait_until)
        self._head: tuple[int, int, bool, bool] | None = None  # status, body start, chunked, keep-alive
        self._length = -1

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self._fail(UpstreamProtocolError("bytes arrived with no request waiting for them"))
            return
        self._buf += data
        try:
            done = self._parse()
        except (ValueError, UpstreamProtocolError) as e:
            err = e if isinstance(e, UpstreamProtocolError) else UpstreamProtocolError("malformed HTTP "
                                                                                       f"response: {e}")
            self._fail(err)
            return
        if done is not None:
            self._waiter.set_result(done)
            self._waiter = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            if exc is None and self._head is not None and self._length == UNTIL_CLOSE and not self._head[2]:
                self._waiter.set_result((self._head[0], bytes(self._buf[self._head[1]:]), False))
            elif not self._buf and self._head is None:
                self._waiter.set_exception(_StaleConnection())
            else:
                self._waiter.set_exception(UpstreamClosed(
                    f"closed the connection mid-response{f': {type(exc).__name__}' if exc else ''}"))

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost reports it

    # -- one exchange ------------------------------------------------------------------------------
    async def exchange(self, request: bytes) -> tuple[int, bytes, bool]:
        """(status, body, keep-alive) for ``request``; the connection is left reusable only when whole."""
        assert self.transport is not None and self._waiter is None
        self._buf.clear()
        self._head = None
        self._length = -1
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self._waiter

    def expire(self) -> None:
        """The request's deadline passed: it fails with ``TimeoutError`` (the caller drops the connection)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TimeoutError())

    def _fail(self, err: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(err)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _parse(self) -> tuple[int, bytes, bool] | None:
        buf = self._buf
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD or (len(buf) >= 8 and not buf.startswith(b"HTTP/1.")):
                    raise UpstreamProtocolError(f"not an HTTP response: {bytes(buf[:80])!r}")
                return None
            lines = bytes(buf[:end]).split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
                raise UpstreamProtocolError(f"not an HTTP response: {lines[0][:80]!r}")
            status = int(parts[1])
            keep = parts[0] == b"HTTP/1.1"
            chunked = False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    self._length = int(value)
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                elif name == b"connection":
                    keep = value.strip().lower() != b"close"
            if status < 200 or status in (204, 304):
                self._length = 0
            elif not chunked and self._length < 0:
                self._length = UNTIL_CLOSE  # the body runs until the server closes (HTTP/1.0 style)
                keep = False
            self._head = (status, end + 4, chunked, keep)
        status, start, chunked, keep = self._head
        if not chunked:
            if self._length == UNTIL_CLOSE or len(buf) - start < self._length:
                return None
            return status, bytes(buf[start:start + self._length]), keep
        body = _dechunk(buf, start)
        return None if body is None else (status, body, keep)


def _dechunk(buf: bytearray, pos: int) -> bytes | None:
    """The body of a whole chunked message in ``buf[pos:]``, or None while it is incomplete."""
    out = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";")[0].strip(), 16)
        pos = eol + 2
        if size == 0:
            while True:  # trailers, then the blank line
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    return None
                if eol == pos:
                    return bytes(out)
                pos = eol + 2
        if len(buf) < pos + size + 2:
            return None
        out += buf[pos:pos + size]
        pos += size + 2


class _Slots:
    """At most ``n`` holders; waiters are served in order, each handed the slot a holder gives back.

    (``asyncio.Semaphore`` looks past every waiter it already woke, on each release: with thousands
    waiting, a burst of releases cost quadratic time on the event loop.)"""

    def __init__(self, n: int) -> None:
        self.free = n
        self.waiters: deque[asyncio.Future[None]] = deque()

    def take(self) -> bool:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def wait(self, deadline: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            async with asyncio.timeout_at(deadline):
                await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot it will not use: pass it on
            else:
                fut.cancel()  # left in the queue; release skips it
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot goes straight to the next waiter
                return
        self.free += 1


class Upstream:
    def __init__(self, api_key: str = "", idle_s: float = IDLE_S, max_connections: int | None = None) -> None:
        self.idle_s = idle_s
        self.max_connections = max_connections
        self._slots: dict[tuple[str, int], _Slots] = {}  # per engine, with max_connections
        # the engine's key (agentrl.engines.guard), sent with every request; empty: none
        self._auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        self._addr: dict[str, tuple[str, int, str]] = {}
        self._buckets: dict[int, set[_Connection]] = {}  # deadline tick -> the exchanges due then
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop whose timers fire the buckets

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
        request = (
            f"POST {prefix}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n{self._auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode("latin-1") + payload
        key = (host, port)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self.max_connections is None:
            return await self._post(key, request, deadline)
        self._bind(loop)
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = _Slots(self.max_connections)
        if not slots.take():
            await slots.wait(deadline)
        try:
            return await self._post(key, request, deadline)
        finally:
            slots.release()

    async def _post(self, key: tuple[str, int], request: bytes, deadline: float) -> tuple[int, bytes]:
        host, port = key
        conn = self._take(key)
        if conn is not None:
            try:
                return await self._exchange(key, conn, request, deadline)
            except _StaleConnection:
                pass  # closed by the server while idle: nothing was read, send it once more
        async with asyncio.timeout_at(deadline):  # (a new connection: rare, a timer of its own)
            conn = await self._open(host, port)
        try:
            return await self._exchange(key, conn, request, deadline)
        except _StaleConnection as e:
            raise UpstreamClosed(f"{host}:{port} closed the connection without answering") from e

    async def _open(self, host: str, port: int) -> _Connection:
        try:
            _, conn = await asyncio.get_running_loop().create_connection(_Connection, host, port)
        except OSError as e:
            raise UpstreamClosed(f"cannot connect to {host}:{port}: {e}") from e
        return conn

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        q = self._idle.get(key)
        now = time.monotonic()
        while q:
            conn = q.pop()
            if now - conn.last_used < self.idle_s and not conn.closed:
                return conn
            conn.close()
        return None

    def _wait_until(self, conn: _Connection, deadline: float) -> None:
        """Put ``conn``'s exchange in the bucket of ``deadline``, whose timer expires what is left in it."""
        loop = asyncio.get_running_loop()
        self._bind(loop)
        tick = int(deadline / TICK_S) + 1  # the bucket's time, tick * TICK_S, is never before the deadline
        bucket = self._buckets.get(tick)
        if bucket is None:
            bucket = self._buckets[tick] = set()
            loop.call_at(tick * TICK_S, self._expire, tick)
        bucket.add(conn)
        conn.bucket = bucket

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:  # buckets and slots of a loop that is gone never fire: start afresh
            self._loop, self._buckets, self._slots = loop, {}, {}

    def _expire(self, tick: int) -> None:
        for conn in self._buckets.pop(tick, ()):
            conn.expire()

    async def _exchange(self, key: tuple[str, int], conn: _Connection, request: bytes,
                        deadline: float) -> tuple[int, bytes]:
        done = keep = False
        self._wait_until(conn, deadline)
        try:
            status, body, keep = await conn.exchange(request)
            done = True
        except UpstreamClosed as e:
            raise UpstreamClosed(f"{key[0]}:{key[1]} {e}") from e
        except UpstreamProtocolError as e:
            raise UpstreamProtocolError(f"{e} (from {key[0]}:{key[1]})") from e
        finally:
            if conn.bucket is not None:
                conn.bucket.discard(conn)
                conn.bucket = None
            if done and keep and not conn.closed:
                conn.last_used = time.monotonic()
                self._idle.setdefault(key, deque()).append(conn)
            else:
                conn.close()  # cancelled, failed or not reusable: never hand back a half-read connection
        return status, body

    async def close(self) -> None:
        for q in self._idle.values():
            while q:
                q.pop().close()
        self._idle.clear()
