"""A small asynchronous client for the Docker Engine HTTP API (unix socket or tcp), built on aiohttp.

Role: the Docker backend's only way to reach the engine, so that thousands of episodes never block
the event loop (the `docker` SDK is synchronous). Also a stdlib, synchronous `remove_by_label` for
the at-exit backstop, which runs when no event loop is left.

Invariants: every call has a timeout; a failure to reach the engine at all (refused, reset, no
socket, timed out) raises SandboxHostDown, an unexpected status SandboxError; removing a container
that is already gone (or going) is not an error.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import aiohttp

from agentrl.sandbox.types import SandboxError, SandboxHostDown

log = logging.getLogger(__name__)

API = "/v1.41"  # Docker 20.10; newer engines still serve it


def _split_host(host: str) -> tuple[str | None, str, int]:
    """(unix socket path, tcp host, tcp port) from a DOCKER_HOST value."""
    if host.startswith("unix://"):
        return host[len("unix://") :], "", 0
    parts = urlsplit(host.replace("tcp://", "http://", 1))
    return None, parts.hostname or "localhost", parts.port or 2375


class DockerAPI:
    def __init__(self, host: str, timeout: float = 60.0) -> None:
        self.host = host
        self.timeout = timeout
        self._unix, self._tcp_host, self._tcp_port = _split_host(host)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = (aiohttp.UnixConnector(path=self._unix, limit=64) if self._unix
                         else aiohttp.TCPConnector(limit=64))
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    def _base(self) -> str:
        return "http://docker" if self._unix else f"http://{self._tcp_host}:{self._tcp_port}"

    async def request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                      body: Any = None, ok: tuple[int, ...] = (200, 201, 204)) -> tuple[int, Any]:
        url = f"{self._base()}{API}{path}"
        try:
            async with self._client().request(method, url, params=params, json=body) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise SandboxHostDown(f"Docker engine at {self.host} unreachable ({method} {path}): {e!r}") from e
        data: Any = raw
        if raw and raw[:1] in (b"{", b"["):
            data = json.loads(raw)
        if status not in ok:
            msg = data.get("message") if isinstance(data, dict) else raw[:300]
            raise SandboxError(f"Docker {method} {path} answered {status}: {msg}")
        return status, data

    async def ping(self) -> None:
        await self.request("GET", "/_ping")

    async def image_exists(self, image: str) -> bool:
        status, _ = await self.request("GET", f"/images/{quote(image, safe='')}/json", ok=(200, 404))
        return status == 200

    async def copy_image(self, image: str, to: DockerAPI) -> None:
        """Stream ``image`` from this engine into the engine ``to`` (``docker save | docker load``
        without the CLI); each read or write may stall at most ``timeout`` s, the whole copy longer."""
        slow = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=to.timeout)
        try:
            async with self._client().get(f"{self._base()}{API}/images/{quote(image, safe='')}/get",
                                          timeout=slow) as src:
                if src.status != 200:
                    raise SandboxError(f"Docker at {self.host} cannot export {image!r}: {src.status}")
                async with to._client().post(f"{to._base()}{API}/images/load", params={"quiet": "1"},
                                             data=src.content.iter_chunked(1 << 20), timeout=slow) as dst:
                    answer = await dst.read()
                    if dst.status != 200 or b'"error' in answer:
                        raise SandboxError(f"Docker at {to.host} could not load {image!r}: "
                                           f"{dst.status} {answer[:300]!r}")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise SandboxHostDown(f"copying {image!r} from {self.host} to {to.host} failed: {e!r}") from e

    async def create(self, body: dict[str, Any]) -> str:
        _, data = await self.request("POST", "/containers/create", body=body, ok=(201,))
        return data["Id"]

    async def start(self, cid: str) -> None:
        await self.request("POST", f"/containers/{cid}/start", ok=(204, 304))

    async def remove(self, cid: str) -> None:
        # 404: gone; 409: removal already in progress (AutoRemove racing us).
        await self.request(
            "DELETE", f"/containers/{cid}", params={"force": "1", "v": "1"}, ok=(204, 404, 409)
        )

    async def inspect(self, cid: str) -> dict[str, Any] | None:
        status, data = await self.request("GET", f"/containers/{cid}/json", ok=(200, 404))
        return data if status == 200 else None

    async def list(self, labels: list[str]) -> list[dict[str, Any]]:
        params = {"all": "1", "filters": json.dumps({"label": labels})}
        _, data = await self.request("GET", "/containers/json", params=params)
        return data

    async def attach(self, cid: str) -> tuple[AsyncIterator[bytes], asyncio.StreamWriter]:
        """Hijack a connection attached to the container's stdin/stdout (before it starts, so that
        nothing is missed). Returns (stdout chunks, stdin writer)."""
        try:
            if self._unix:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(self._unix), self.timeout
                )
            else:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self._tcp_host, self._tcp_port), self.timeout)
            query = urlencode({"stream": 1, "stdin": 1, "stdout": 1, "stderr": 1})
            writer.write(
                f"POST {API}/containers/{cid}/attach?{query} HTTP/1.1\r\nHost: docker\r\n"
                "Connection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: 0\r\n\r\n".encode())
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), self.timeout)
            while (await asyncio.wait_for(reader.readline(), self.timeout)) not in (b"\r\n", b""):
                pass
        except (OSError, TimeoutError) as e:
            raise SandboxHostDown(f"Docker engine at {self.host}: attach to {cid[:12]} failed: {e!r}") from e
        code = status_line.split(b" ", 2)[1:2]
        if code not in ([b"101"], [b"200"]):
            writer.close()
            raise SandboxError(f"Docker attach to {cid[:12]} answered {status_line!r}")
        return _demux(reader, cid[:12]), writer

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _demux(reader: asyncio.StreamReader, name: str) -> AsyncIterator[bytes]:
    """Docker multiplexes a non-tty container's output: 8-byte header (stream, 0, 0, 0, size BE)."""
    while True:
        try:
            header = await reader.readexactly(8)
            data = await reader.readexactly(int.from_bytes(header[4:8], "big"))
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        if header[0] == 1:
            yield data
        else:
            log.debug("sandbox %s agent stderr: %s", name, data.decode(errors="replace").rstrip())


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("docker", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def remove_by_label(host: str, label: str, timeout: float = 30.0) -> int:
    """Synchronously force-remove every container carrying `label` (key=value). Returns how many.

    For the at-exit backstop: no event loop, no aiohttp, just the standard library."""
    unix, tcp_host, tcp_port = _split_host(host)

    def call(method: str, path: str) -> tuple[int, bytes]:
        conn = (_UnixHTTPConnection(unix, timeout) if unix
                else http.client.HTTPConnection(tcp_host, tcp_port, timeout=timeout))
        try:
            conn.request(method, API + path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    filters = quote(json.dumps({"label": [label]}))
    status, body = call("GET", f"/containers/json?all=1&filters={filters}")
    if status != 200:
        raise SandboxError(f"Docker list answered {status}: {body[:200]!r}")
    removed = 0
    for c in json.loads(body):
        st, _ = call("DELETE", f"/containers/{c['Id']}?force=1&v=1")
        removed += st in (204, 404, 409)
    return removed
