"""serve's HTTP conventions, shared by every route it serves (router, buffer, weights, admin).

- One bearer parsing: ``Authorization: Bearer <token>``, the scheme case-insensitive (RFC 7235), the
  token compared in constant time.
- One error shape: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's), whatever the route;
  :func:`error_response` builds it, :func:`error_middleware` turns aiohttp's HTTP exceptions and any
  unforeseen exception into it, so no route answers an HTML page or a bare string.
"""

from __future__ import annotations

import hmac
import logging
import socket
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentrl.errors import AgentrlError

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

log = logging.getLogger(__name__)

ADMIN_TOKEN = web.AppKey("agentrl_admin_token", str)

# error "type" by status, when the raiser did not say
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def bearer(request: web.Request) -> str | None:
    """The bearer token of a request, or None (the scheme is matched case-insensitively)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def token_matches(given: str | None, expected: str) -> bool:
    return bool(expected) and given is not None and hmac.compare_digest(given.encode(), expected.encode())


def error_body(message: str, status: int, *, type: str | None = None, code: str | None = None,
               param: str | None = None, **extra: Any) -> dict[str, Any]:
    err = {
        "message": message,
        "type": type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        "param": param,
        "code": code,
    }
    return {"error": err, **extra}


def error_response(
    message: str, status: int, *, headers: dict[str, str] | None = None, **kw: Any
) -> web.Response:
    return web.json_response(error_body(message, status, **kw), status=status, headers=headers)


class Unauthorized(web.HTTPUnauthorized, AgentrlError):
    """A missing or wrong admin token (answered 401 in the one error shape). An aiohttp answer
    first (its middleware turns it into the 401), and one of agentrl's refusals like any other."""


def require_admin(request: web.Request) -> None:
    """Refuse a request without serve's admin token (no token configured: every request passes)."""
    expected = request.app.get(ADMIN_TOKEN, "")
    if expected and not token_matches(bearer(request), expected):
        raise Unauthorized(reason="this route needs the admin token (Authorization: Bearer <admin token>)")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's HTTP errors and unforeseen exceptions as the one error shape (routes with their own
    error type, like the router's, answer it themselves and pass through untouched)."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.reason or e.text or "error", e.status,
                              headers={k: v for k, v in e.headers.items() if k.lower() == "retry-after"})
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response("internal server error", 500, type="server_error")


async def listen_when_free(host: str, port: int, timeout_s: float = 60.0) -> socket.socket:
    """:func:`listen`, waiting up to ``timeout_s`` while the port is in use (a serve killed just now
    may leave a process holding it for a moment); then an OSError that names the port."""
    import asyncio
    import errno
    import time

    deadline, told = time.monotonic() + timeout_s, False
    while True:
        try:
            return listen(host, port)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            if time.monotonic() > deadline:
                raise OSError(e.errno, f"port {port} on {host} is in use after {timeout_s:.0f} s (another "
                                       "serve? `ss -ltnp` names it); set router.port to a free port") from e
            if not told:
                log.warning("port %d on %s is in use; waiting up to %.0f s for it", port, host, timeout_s)
                told = True
        await asyncio.sleep(0.5)


@web.middleware
async def close_after_response(request: web.Request, handler: Handler) -> web.StreamResponse:
    """For an app about to hand its port over (serve's start-up page): each answer says
    ``Connection: close``, so no client keeps a connection to it across the handover."""
    response = await handler(request)
    response.force_close()
    return response


async def hand_over(
    listener: socket.socket, old: web.AppRunner, new: web.AppRunner, drain_s: float = 10.0
) -> None:
    """Move ``listener`` from the routes of ``old`` to those of ``new`` with no client refused or
    reset: ``new`` accepts on it first, then ``old`` stops accepting and answers the connections it
    already holds (a client may have connected and not yet sent its request) before it shuts down;
    a connection still open after ``drain_s`` (a client that sends nothing) is closed then."""
    import asyncio
    import time

    await web.SockSite(new, listener.dup()).start()
    for site in list(old.sites):
        await site.stop()
    await asyncio.sleep(0)  # a connection accepted just before the stop gets its handler
    deadline = time.monotonic() + drain_s
    while old.server is not None and old.server.connections and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if old.server is not None and old.server.connections:
        log.warning(
            "closing %d idle connection(s) of the start-up page after %.0f s",
            len(old.server.connections),
            drain_s,
        )
    await old.cleanup()


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket for ``host:port``, to hand to ``web.SockSite``. serve keeps one
    socket from its start-up status page to its real routes (``dup`` for each site), so the port never
    closes between them and no client is refused or reset in the handover."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.create_server(addr[:2], family=family, backlog=1024)
    sock.setblocking(False)
    return sock


async def start_on_loopback(app: web.Application, **runner_options: Any) -> tuple[web.AppRunner, str]:
    """``app`` served on a free port of 127.0.0.1 (an in-process stand-in, a relay, a test's or a
    benchmark's server): its runner, which the caller cleans up, and its base URL."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _ephemeral_range() -> tuple[int, int]:
    try:
        from pathlib import Path

        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port of ``host`` that nothing is bound to now, with the ``span - 1`` ports after it free too
    (engines listen on ``base_port + i``), for a server a test or a benchmark starts and may start
    again. It is drawn below the kernel's ephemeral range: once a server on an ephemeral port stops,
    any outgoing connection of the machine may take that port as its local one, and the server,
    started again on it, would find it held for as long as that connection lives."""
    import random

    low = 20000
    high = min(_ephemeral_range()[0], 65536) - span
    if high <= low:  # an unusual range: the kernel's choice then
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    draw = random.Random()  # its own: a seeded global generator would give every process the same ports
    for _ in range(200):
        port = draw.randrange(low, high)
        try:
            for p in range(port, port + span):
                with socket.socket() as s:
                    s.bind((host, p))
        except OSError:
            continue
        return port
    raise OSError(f"no free port between {low} and {high} on {host}")
