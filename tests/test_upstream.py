"""The router's hot-path HTTP client against small real servers (asyncio, loopback TCP)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from agentrl.engines.upstream import Upstream, UpstreamClosed, UpstreamProtocolError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One POST's body, or None when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


async def serve(handler: Handler) -> tuple[asyncio.Server, str, dict[str, Any]]:
    state: dict[str, Any] = {"connections": 0}

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state["connections"] += 1
        try:
            await handler(reader, writer, state)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", state


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra + \
        b"Content-Length: %d\r\n\r\n" % len(body) + body


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
    while (body := await read_request(reader)) is not None:
        writer.write(ok(body))
        await writer.drain()


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


def test_content_length_answers_reuse_one_connection() -> None:
    async def go() -> None:
        server, url, state = await serve(echo)
        up = Upstream()
        try:
            for i in range(5):
                status, body = await up.post(url, "/v1/x", b'{"i": %d}' % i, 5)
                assert (status, body) == (200, b'{"i": %d}' % i)
            assert state["connections"] == 1
            # concurrent calls each take their own connection, then are all kept
            outs = await asyncio.gather(*(up.post(url, "/v1/x", b"%d" % i, 5) for i in range(4)))
            assert [b for _, b in outs] == [b"%d" % i for i in range(4)]
            assert state["connections"] == 4
        finally:
            await up.close()
            server.close()
    run(go())


def test_chunked_answers_arriving_a_few_bytes_at_a_time_and_an_answer_that_runs_until_close() -> None:
    async def chunked(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]
    ) -> None:
        while await read_request(reader) is not None:
            msg = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n")
            for i in range(0, len(msg), 3):
                writer.write(msg[i:i + 3])
                await writer.drain()
                await asyncio.sleep(0)

    async def http10(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 201 Created\r\n\r\nbody until close")
        await writer.drain()

    async def go() -> None:
        s1, url1, st1 = await serve(chunked)
        s2, url2, st2 = await serve(http10)
        up = Upstream()
        try:
            assert await up.post(url1, "/a", b"{}", 5) == (200, b"hello, world")
            assert await up.post(url1, "/a", b"{}", 5) == (200, b"hello, world")
            assert st1["connections"] == 1
            assert await up.post(url2, "/b", b"{}", 5) == (201, b"body until close")
            assert await up.post(url2, "/b", b"{}", 5) == (201, b"body until close")
            assert st2["connections"] == 2  # not kept: the server closed it
        finally:
            await up.close()
            s1.close()
            s2.close()
    run(go())


def test_a_keep_alive_connection_the_server_closed_while_idle_is_retried_on_a_fresh_one() -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        body = await read_request(reader)
        writer.write(ok(body or b""))  # keep-alive promised, then closed (as an idle timeout does)
        await writer.drain()

    async def go() -> None:
        server, url, state = await serve(once)
        up = Upstream()
        try:
            assert await up.post(url, "/x", b"1", 5) == (200, b"1")
            await asyncio.sleep(0.1)
            assert await up.post(url, "/x", b"2", 5) == (200, b"2")
            assert state["connections"] == 2
        finally:
            await up.close()
            server.close()
    run(go())


def test_failures_are_named_closed_mid_answer_not_http_refused_and_timed_out() -> None:
    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial")
        await writer.drain()

    async def garbage(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]
    ) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]
    ) -> None:
        await read_request(reader)
        await asyncio.sleep(10)

    async def go() -> None:
        up = Upstream()
        servers = []
        try:
            s, url, _ = await serve(half)
            servers.append(s)
            with pytest.raises(UpstreamClosed, match="mid-response"):
                await up.post(url, "/x", b"{}", 5)
            s, url, _ = await serve(garbage)
            servers.append(s)
            with pytest.raises(UpstreamProtocolError, match="not an HTTP response"):
                await up.post(url, "/x", b"{}", 5)
            s, url, state = await serve(silent)
            servers.append(s)
            with pytest.raises(TimeoutError):
                await up.post(url, "/x", b"{}", 0.3)
            # the timed-out one is not kept
            assert not up._idle.get(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            port = url.rsplit(":", 1)[1]
            s.close()
            await s.wait_closed()
            with pytest.raises(UpstreamClosed, match="cannot connect"):
                await up.post(f"http://127.0.0.1:{port}", "/x", b"{}", 5)
        finally:
            await up.close()
            for s in servers:
                s.close()
    run(go())


def test_a_kept_alive_connection_times_out_on_time_and_is_dropped() -> None:
    async def once_then_silent(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]
    ) -> None:
        body = await read_request(reader)
        writer.write(ok(body or b""))
        await writer.drain()
        await read_request(reader)
        await asyncio.sleep(10)

    async def go() -> None:
        server, url, state = await serve(once_then_silent)
        up = Upstream()
        try:
            assert await up.post(url, "/x", b"{}", 5) == (200, b"{}")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(TimeoutError):
                await up.post(url, "/x", b"{}", 0.3)  # on the kept-alive connection
            waited = loop.time() - t0
            # never early; and the deadline, not the server's 10 s silence, ended it (how late it
            # fires on a loaded machine is benchmark matter, not a test's)
            assert 0.3 <= waited < 5, waited
            assert not up._buckets or all(not b for b in up._buckets.values())
            server.close()
            server, url, state = await serve(echo)
            assert await up.post(url, "/x", b"{}", 5) == (200, b"{}")  # a new connection, not the dead one
        finally:
            await up.close()
            server.close()

    run(go())


def test_max_connections_holds_calls_beyond_it_until_one_is_free() -> None:
    async def slow_echo(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]
    ) -> None:
        while (body := await read_request(reader)) is not None:
            state["in_flight"] = state.get("in_flight", 0) + 1
            state["most"] = max(state.get("most", 0), state["in_flight"])
            await asyncio.sleep(0.05)
            state["in_flight"] -= 1
            writer.write(ok(body))
            await writer.drain()

    async def go() -> None:
        server, url, state = await serve(slow_echo)
        up = Upstream(max_connections=2)
        try:
            got = await asyncio.gather(*(up.post(url, "/x", b"%d" % i, 5) for i in range(6)))
            assert got == [(200, b"%d" % i) for i in range(6)]
            assert state["most"] == 2 and state["connections"] == 2
            with pytest.raises(TimeoutError):  # waiting for a connection counts against the timeout
                await asyncio.gather(*(up.post(url, "/x", b"{}", 0.08) for _ in range(6)))
        finally:
            await up.close()
            server.close()

    run(go())
