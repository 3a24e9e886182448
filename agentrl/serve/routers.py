"""Routers beside serve's: a rollout worker's own, and serve's endpoint as several processes.

:class:`FollowingRouter` is the router serve builds (:func:`agentrl.serve.build.build_router`, the
same config), in another process, over a pool of the same engines that follows serve's view of
them. ``serve --ray``'s rollout workers run one each (``ray.local_router``), so their model calls
never cross serve.

``router.processes = N`` runs serve's public endpoint as N router processes that accept on serve's
one listening socket (inherited, so the kernel hands each connection to whichever process accepts
it first): serve's own process (0) and N - 1 children (``python -m agentrl.serve.routers``), each a
:class:`FollowingRouter`. A session lives in exactly one process, its owner,
``crc32(session id) mod N`` (:func:`owner_of`); a process that receives a call of a session it
does not own passes it, bytes in and bytes out (streams included), to the owner over the owner's
unix socket in a private folder (mode 0700: only serve's user can open it), so a session's calls
always meet its state, whichever process the client's connection reached. Ids a process makes up
(``POST /admin/sessions`` without one) are ones it owns. Everything that is not a model call or a
session route (the buffer, weights, status, metrics, the view) belongs to serve, process 0. Calls
with no session go to no one in particular: whichever process took the connection answers.
Requests that arrive on a private socket are answered where they arrive, never passed on again.

serve restarts a child that dies (its open sessions are lost, as a restarted serve's are) and
reports each child's router counters in its status; its ``/metrics`` exposition (its own
``prometheus_client`` registry, polled every 2 s) joins serve's, labelled ``process``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from agentrl.procs import tied_to_this_process
from agentrl.serve.config import ServeConfig

log = logging.getLogger(__name__)

# what a proxy never passes on (RFC 9110 7.6.1), and what aiohttp sets itself; Host is passed on
# (the owner answers with URLs of the address the client called)
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "trailers", "transfer-encoding", "upgrade", "content-length"})


class FollowingRouter:
    """A router of serve's kind in another process: the router serve runs, built from the same
    config, over a pool of the same engines, so its model calls go straight to the engines with
    the same capture and exact tokens.

    serve stays the one that decides which engines take traffic and at which version (it reloads a
    returning engine's weights before letting it in): every ``FOLLOW_S`` the pool takes serve's
    ``/admin/engines`` view (:meth:`~agentrl.engines.pool.EnginePool.follow`). Between two looks a
    weight update needs nothing from here: vLLM holds requests that arrive while it is paused, and
    every sampled token carries the version that produced it. :meth:`serve_http` answers the model
    routes on a loopback port of its own (a rollout worker's scaffold programs call it there), to
    the sessions this router opened only (a random client key refuses every other call).
    """

    FOLLOW_S = 1.0

    def __init__(self, cfg: ServeConfig, serve_url: str, admin_token: str, engine_key: str,
                 model_path: str, run_dir: Path | None = None, serve_socket: str = "") -> None:
        """``run_dir``: where its sessions' records go (``<run_dir>/sessions``, as serve's); None: none.
        ``serve_socket``: reach serve over this unix socket instead of ``serve_url``."""
        self.cfg, self.serve_url, self.admin_token = cfg, serve_url, admin_token
        self.serve_socket = serve_socket
        self.engine_key, self.model_path, self.run_dir = engine_key, model_path, run_dir
        self.router: Any = None
        self._runner: web.AppRunner | None = None
        self._following: asyncio.Task | None = None
        self._client: Any = None

    async def start(self) -> Any:
        """Build the router over serve's current engines; the router."""
        from agentrl.client import ServeClient
        from agentrl.models import is_moe
        from agentrl.serve import build

        self._client = ServeClient(self.serve_url, self.admin_token, timeout_s=30.0,
                                   unix_socket=self.serve_socket)
        view = await self._client.json("GET", "/admin/engines")
        pool = build.build_pool(self.cfg, [e["url"] for e in view["engines"]], api_key=self.engine_key)
        pool.follow(view)
        pool.on_rejoin = self._serve_decides
        await pool.start()
        self.router = build.build_router(self.cfg, pool, self.model_path, self.run_dir)
        if is_moe(self.model_path):
            await self.router.capture_experts()
        self._following = asyncio.create_task(self._follow(), name="follow-serve-engines")
        return self.router

    @staticmethod
    async def _serve_decides(engine: Any) -> bool:
        return False  # an engine out of this pool comes back when serve's view has it back in

    async def _follow(self) -> None:
        from agentrl.errors import TransportError

        failing = False
        while True:
            await asyncio.sleep(self.FOLLOW_S)
            try:
                view = await self._client.json("GET", "/admin/engines", retries=0, timeout_s=10.0)
            except TransportError as e:
                if not failing:  # said once per outage; the pool keeps its last view meanwhile
                    log.warning("cannot read serve's engine pool (%s); keeping the last view", e)
                failing = True
                continue
            if failing:
                log.info("reading serve's engine pool again")
                failing = False
            self.router.pool.follow(view)

    async def serve_http(self) -> str:
        """Answer the router's model routes on a loopback port of this process; its base URL."""
        import secrets

        from agentrl.router.server import make_app

        app = make_app(self.router, admin_token=self.admin_token,
                       api_keys=frozenset({secrets.token_urlsafe(24)}),
                       client_max_size=self.cfg.router.max_body_mb << 20)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def close(self) -> None:
        if self._following is not None:
            self._following.cancel()
            await asyncio.gather(self._following, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.router is not None:
            await self.router.flush_log()
            self.router.close()
            await self.router.pool.close()
        if self._client is not None:
            await self._client.close()


# -- several router processes: who answers what ---------------------------------------------------
def owner_of(session_id: str, count: int) -> int:
    """The router process that holds session ``session_id`` among ``count`` (the same in every one)."""
    return zlib.crc32(session_id.encode("utf-8", "surrogatepass")) % count


def _session_of_headers(request: web.Request) -> str | None:
    """The session a model call names in its headers (unchecked: the owner checks it)."""
    from agentrl.router.http import client_key

    key = client_key(request) or ""
    named = key[5:] if key.startswith("sess-") else ""
    return request.headers.get("X-Agentrl-Session") or named or None


async def route_of(request: web.Request, count: int) -> int | None:
    """Which of ``count`` router processes must answer ``request``: a session's owner, 0 (serve)
    for serve's own routes, None for any (a model call without a session, ``/health``)."""
    path = request.path
    parts = path.split("/")
    if path.startswith("/sessions/") and len(parts) > 2 and parts[2]:
        return owner_of(parts[2], count)
    if path.startswith("/admin/sessions/") and len(parts) > 3 and parts[3]:
        return owner_of(parts[3], count)
    if path == "/admin/sessions":
        if request.method != "POST":
            return 0
        try:  # the body is read once and kept: the handler reads it again from memory
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            return None  # the handler that receives it says what is wrong
        sid = body.get("session_id") if isinstance(body, dict) else None
        return owner_of(sid, count) if isinstance(sid, str) and sid else None
    if path.startswith("/v1/") or path == "/health":
        sid = _session_of_headers(request)
        return owner_of(sid, count) if sid else None
    return 0


class Forwarder:
    """Passes a request to another router process over its unix socket and its answer back, bytes
    for bytes (a stream as it comes); counts ``forwarded`` and ``forward_failures`` in ``counters``."""

    def __init__(self, sockets_dir: Path, counters: dict[str, float], timeout_s: float) -> None:
        self.sockets_dir = sockets_dir
        self.counters = counters
        counters.setdefault("forwarded", 0)
        counters.setdefault("forward_failures", 0)
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s)
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def _session(self, target: int) -> aiohttp.ClientSession:
        s = self._sessions.get(target)
        if s is None or s.closed:
            connector = aiohttp.UnixConnector(path=str(socket_path(self.sockets_dir, target)), limit=0)
            s = self._sessions[target] = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                               skip_auto_headers=("User-Agent",))
        return s

    async def forward(self, request: web.Request, target: int) -> web.StreamResponse:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        body = await request.read()
        try:
            upstream = await self._session(target).request(
                request.method, f"http://router{request.rel_url}", headers=headers, data=body,
                allow_redirects=False, timeout=self.timeout)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self.counters["forward_failures"] += 1
            log.warning("router process %d did not take a forwarded call: %s", target, e)
            return web.json_response(
                {"error": {"message": f"router process {target}, which holds this session, is not answering "
                                      "(restarting?); try again", "type": "unavailable", "param": None,
                           "code": "router_process_unavailable"}},
                status=503, headers={"Retry-After": "1"})
        self.counters["forwarded"] += 1
        async with upstream:
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP:
                    out.headers.add(k, v)
            if upstream.content_length is not None:
                out.content_length = upstream.content_length
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
        return out

    async def close(self) -> None:
        for s in self._sessions.values():
            await s.close()


def socket_path(sockets_dir: Path, index: int) -> Path:
    return sockets_dir / f"router-{index}.sock"


def affinity(index: int, count: int, forwarder: Forwarder, public_port: int) -> Callable[..., Awaitable[Any]]:
    """The middleware that sends a request that arrived on the shared public port to the process
    that must answer it (:func:`route_of`); a request on any other socket is answered here."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
        transport = request.transport
        name = transport.get_extra_info("sockname") if transport is not None else None
        if not (isinstance(name, tuple) and len(name) >= 2 and name[1] == public_port):
            return await handler(request)
        target = await route_of(request, count)
        if target is None or target == index:
            return await handler(request)
        return await forwarder.forward(request, target)

    return middleware


def make_process(app: web.Application, router: Any, index: int, count: int, sockets_dir: Path,
                 public_port: int, timeout_s: float) -> Forwarder:
    """Make ``app`` (over ``router``, before it starts) router process ``index`` of ``count``: it
    passes on what another process must answer, and the session ids it makes up are its own."""
    forwarder = Forwarder(sockets_dir, router.counters, timeout_s)
    app.middlewares.insert(1, affinity(index, count, forwarder, public_port))
    router.store.claims = lambda sid: owner_of(sid, count) == index
    return forwarder


# -- serve's side: the children ---------------------------------------------------------------------
class RouterProcesses:
    """serve's N - 1 router children (process 0 is serve): spawned on serve's listening socket,
    restarted when one dies, their counters and metrics polled for serve's status and /metrics."""

    def __init__(self, cfg: ServeConfig, *, admin_token: str, engine_key: str, model_path: str, run_dir: Path,
                 api_keys: frozenset[str], listener: socket.socket) -> None:
        self.cfg, self.count = cfg, cfg.router.processes
        self.listener = listener
        self._spec = {"cfg": cfg.without_secrets(), "admin_token": admin_token, "engine_key": engine_key,
                      "model_path": model_path, "run_dir": str(run_dir), "api_keys": sorted(api_keys),
                      "count": self.count}
        self.log_dir = run_dir / "logs"
        self.dir = Path(tempfile.mkdtemp(prefix="agentrl-routers-"))  # 0700: only serve's user
        self.procs: dict[int, subprocess.Popen] = {}
        self.info: dict[int, dict[str, Any]] = {}
        self.forwarder: Forwarder | None = None  # process 0's (install)
        self.expositions: dict[int, str] = {}  # each child's /metrics, as last polled
        self._http: dict[int, aiohttp.ClientSession] = {}
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    def install(self, app: web.Application, router: Any) -> None:
        """Make serve's app process 0: its middleware and its session ids (before the app starts)."""
        self.forwarder = make_process(app, router, 0, self.count, self.dir, self.listener.getsockname()[1],
                                      self.cfg.router.request_timeout_s)

    async def start(self, runner: web.AppRunner, timeout_s: float) -> None:
        """Open process 0's private socket on ``runner``, then start the children and wait for each."""
        await web.UnixSite(runner, str(socket_path(self.dir, 0))).start()
        await asyncio.gather(*(self._spawn(i, timeout_s) for i in range(1, self.count)))
        self._tasks = [asyncio.create_task(self._supervise(), name="router-processes")]
        log.info("serving through %d router processes (sessions by owner; %s)", self.count, self.dir)

    async def private_site(self, runner: web.AppRunner) -> str:
        """A loopback port of serve's own on ``runner`` (every call there answered by serve, never
        passed on): where serve's own scaffold programs reach the sessions serve opened with ids
        of its choosing, which another process may own by hash. Its base URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        await web.SockSite(runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def _spawn(self, index: int, timeout_s: float) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"router-{index}.log", "ab")  # noqa: SIM115 - the child's, closed below
        spec = dict(self._spec, index=index, fd=self.listener.fileno(), sockets_dir=str(self.dir))
        proc = subprocess.Popen([sys.executable, "-m", "agentrl.serve.routers"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=out, pass_fds=(self.listener.fileno(),),
                                preexec_fn=tied_to_this_process())
        out.close()
        self.procs[index] = proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(pickle.dumps(spec))  # the secrets go through a pipe, never a command line
        proc.stdin.close()
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout_s)
        except TimeoutError:
            proc.kill()
            raise RuntimeError(f"router process {index} did not start within {timeout_s:.0f} s; "
                               f"see {self.log_dir / f'router-{index}.log'}") from None
        if line.strip() != b"ready":
            proc.wait()
            raise RuntimeError(f"router process {index} exited while starting (code {proc.returncode}); "
                               f"see {self.log_dir / f'router-{index}.log'}")
        self.info[index] = {"process": index, "pid": proc.pid}

    async def _supervise(self) -> None:
        while not self._closing:
            await asyncio.sleep(2.0)
            for index, proc in list(self.procs.items()):
                if proc.poll() is not None and not self._closing:
                    log.warning("router process %d (pid %d) exited with %s; its open sessions are lost; "
                                "restarting it", index, proc.pid, proc.returncode)
                    self.info[index] = {"process": index, "restarting": True}
                    self.expositions.pop(index, None)
                    try:
                        await self._spawn(index, self.cfg.engine.start_timeout_s)
                    except RuntimeError as e:
                        log.warning("%s", e)
                    continue
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                    data = await (await self._ask(index, "/admin/engines")).json()
                    self.info[index] = {"process": index, "pid": proc.pid, "router": data["counters"]}
                    self.expositions[index] = await (await self._ask(index, "/metrics")).text()

    async def _ask(self, index: int, path: str) -> aiohttp.ClientResponse:
        """GET ``path`` of child ``index`` over its unix socket (one connection pool per child, kept),
        its body read; a status other than 200 raises."""
        http = self._http.get(index)
        if http is None or http.closed:
            connector = aiohttp.UnixConnector(path=str(socket_path(self.dir, index)), limit=2)
            http = self._http[index] = aiohttp.ClientSession(connector=connector)
        async with http.get(f"http://router{path}", timeout=aiohttp.ClientTimeout(total=5),
                            headers={"Authorization": f"Bearer {self._spec['admin_token']}"}) as r:
            r.raise_for_status()
            await r.read()
            return r

    def others(self) -> list[tuple[str, str, str]]:
        """Each child's last polled ``/metrics`` exposition, labelled with its index, for serve's
        ``/metrics`` (at most 2 s old)."""
        return [("process", str(i), self.expositions[i]) for i in sorted(self.expositions)]

    def status(self) -> list[dict[str, Any]]:
        return [dict(self.info[i]) for i in sorted(self.info)]

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.forwarder is not None:
            await self.forwarder.close()
        for http in self._http.values():
            await http.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- a child ----------------------------------------------------------------------------------------
async def _child(spec: dict[str, Any]) -> None:
    from agentrl.router.server import make_app

    index, count = spec["index"], spec["count"]
    cfg: ServeConfig = spec["cfg"]
    sockets_dir = Path(spec["sockets_dir"])
    own = FollowingRouter(cfg, "http://serve", spec["admin_token"], spec["engine_key"], spec["model_path"],
                          Path(spec["run_dir"]), serve_socket=str(socket_path(sockets_dir, 0)))
    router = await own.start()
    listener = socket.socket(fileno=spec["fd"])
    app = make_app(router, admin_token=spec["admin_token"], api_keys=frozenset(spec["api_keys"]),
                   client_max_size=cfg.router.max_body_mb << 20)
    forwarder = make_process(app, router, index, count, sockets_dir, listener.getsockname()[1],
                             cfg.router.request_timeout_s)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(socket_path(sockets_dir, index))).start()
    await web.SockSite(runner, listener).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.dup2(2, 1)  # serve reads one line from the pipe; anything later printed goes to the log
    log.info("router process %d of %d (pid %d) serving", index, count, os.getpid())
    await stop.wait()
    await runner.cleanup()
    await forwarder.close()
    await own.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    spec = pickle.loads(sys.stdin.buffer.read())  # from serve, its parent, through a pipe
    asyncio.run(_child(spec))


if __name__ == "__main__":
    main()
