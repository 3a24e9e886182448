"""serve's port moves from its start-up page to its real routes with no client refused or reset.

The case CI caught: a client had connected to the start-up page (the kernel and the page's server
had accepted it) but its request had not arrived when the page shut down, so the page closed the
connection under it. :func:`agentrl.web.hand_over` lets the page answer what it accepted first.
"""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from agentrl.web import close_after_response, hand_over, listen


async def _runner(status: int, *, closing: bool) -> web.AppRunner:
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": status}, status=status)

    app = web.Application(middlewares=[close_after_response] if closing else [])
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    return runner


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET /health HTTP/1.1\r\nHost: serve\r\n\r\n")
    await writer.drain()
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)


async def _page_with_a_connection() -> tuple[socket.socket, int, web.AppRunner, web.AppRunner, tuple]:
    """A listening socket, the start-up page on it, the real routes not yet, and one client
    connection the page has accepted (nothing sent on it yet)."""
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    starting, real = await _runner(503, closing=True), await _runner(200, closing=False)
    await web.SockSite(starting, sock.dup()).start()
    conn = await asyncio.open_connection("127.0.0.1", port)
    await _until(lambda: starting.server.connections, "the start-up page accepted the connection")
    return sock, port, starting, real, conn


async def _until(condition, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_a_connection_the_start_up_page_accepted_before_the_handover_is_answered() -> None:
    async def main() -> tuple[bytes, bytes, bytes]:
        sock, port, starting, real, early = await _page_with_a_connection()
        handover = asyncio.create_task(hand_over(sock, starting, real))
        await _until(lambda: not starting.sites, "the start-up page stopped accepting")
        # the request of the connection it accepted arrives only now, in the middle of the handover
        answer = await _get(*early)
        await asyncio.wait_for(handover, 10)
        closed = await asyncio.wait_for(early[0].read(), 10)  # it said Connection: close, and closed
        after = await _get(*await asyncio.open_connection("127.0.0.1", port))
        await real.cleanup()
        sock.close()
        return answer, closed, after

    answer, closed, after = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 503") and b"Connection: close" in answer, answer
    assert closed == b'{"status": 503}', closed
    assert after.startswith(b"HTTP/1.1 200"), after


def test_a_client_that_never_sends_holds_the_handover_only_for_its_bound() -> None:
    async def main() -> tuple[bytes, bytes]:
        sock, port, starting, real, silent = await _page_with_a_connection()
        await asyncio.wait_for(hand_over(sock, starting, real, drain_s=0.5), 10)
        dropped = await asyncio.wait_for(silent[0].read(), 10)  # closed at the bound, nothing answered
        after = await _get(*await asyncio.open_connection("127.0.0.1", port))
        await real.cleanup()
        sock.close()
        return dropped, after

    dropped, after = asyncio.run(main())
    assert dropped == b""
    assert after.startswith(b"HTTP/1.1 200"), after
