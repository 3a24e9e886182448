"""A TCP proxy that partitions the network between two processes (a test helper).

:class:`Proxy` listens on a free loopback port and forwards each connection to ``upstream``. Its
``mode`` says what the network does, for new and existing connections alike:

- ``pass``: bytes flow both ways.
- ``drop``: connections are refused: existing ones are reset (RST, SO_LINGER 0) and new ones are
  accepted and reset at once, so the client sees ``connection reset``/``refused`` right away.
- ``blackhole``: nothing answers: new connections are accepted and what they send is read and
  thrown away; existing ones stop delivering in both directions, and stay dead once the partition
  heals (what a lost NAT or conntrack entry does). Only the client's own timeout ends them.

:meth:`Proxy.cut_after` blackholes the next connection that forwards more than ``n`` bytes
upstream, once: with ``n`` above any small request, it cuts a weight upload in the middle of its
body, deterministically.

The proxy runs its own event loop on a daemon thread, so a synchronous test drives it.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from dataclasses import dataclass, field

MODES = ("pass", "drop", "blackhole")


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    dead: bool = False  # blackholed: read and discard, never deliver again
    upstream_bytes: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), as a dropping firewall's REJECT or a dead peer does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class Proxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.mode = "pass"
        self.port = 0
        self.cuts = 0  # connections cut by cut_after
        self.connections = 0
        self._cut_after: int | None = None
        self._conns: set[_Conn] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="netproxy")
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ control (any thread)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        asyncio.run_coroutine_threadsafe(self._set_mode(mode), self._loop).result(10)

    def cut_after(self, n: int) -> None:
        """Blackhole the next connection (new or open) once it has sent more than ``n`` bytes upstream."""
        self._loop.call_soon_threadsafe(setattr, self, "_cut_after", n)

    @property
    def cut_pending(self) -> bool:
        return self._cut_after is not None

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for c in list(self._conns):
                self._kill(c)
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # ------------------------------------------------------------------ the loop's side

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _set_mode(self, mode: str) -> None:
        self.mode = mode
        for c in list(self._conns):
            if mode == "drop":
                self._kill(c)
            elif mode == "blackhole":
                c.dead = True

    def _kill(self, c: _Conn) -> None:
        for w in (c.client, c.server):
            if w is not None:
                _reset(w)
        for t in c.tasks:
            t.cancel()
        self._conns.discard(c)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        c = _Conn(writer)
        if self.mode == "drop":
            _reset(writer)
            return
        self._conns.add(c)
        if self.mode == "blackhole":
            c.dead = True
            await self._discard(reader)
            return
        try:
            up_reader, c.server = await asyncio.open_connection(*self.upstream)
        except OSError:
            self._kill(c)
            return
        c.tasks = [asyncio.current_task()]  # type: ignore[list-item]
        back = asyncio.ensure_future(self._pipe(c, up_reader, c.client, upstream=False))
        c.tasks.append(back)
        try:
            await self._pipe(c, reader, c.server, upstream=True)
            if not c.dead:
                await back
        finally:
            self._conns.discard(c)

    async def _discard(self, reader: asyncio.StreamReader) -> None:
        try:
            while await reader.read(1 << 16):
                pass
        except (OSError, asyncio.CancelledError):
            pass

    async def _pipe(self, c: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                    upstream: bool) -> None:
        try:
            while data := await reader.read(1 << 16):
                if upstream and not c.dead:
                    c.upstream_bytes += len(data)
                    if self._cut_after is not None and c.upstream_bytes > self._cut_after:
                        self._cut_after = None
                        self.cuts += 1
                        c.dead = True
                if c.dead:
                    continue  # read and thrown away: the peer never hears of it
                writer.write(data)
                await writer.drain()
            if not c.dead:
                writer.write_eof()
        except (OSError, RuntimeError):
            if not c.dead:
                self._kill(c)
        except asyncio.CancelledError:
            pass
