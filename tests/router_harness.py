"""Test helper: serve a real Router over HTTP on a loopback port, from a background thread.

The official (synchronous) ``openai`` client then talks to it exactly as a scaffold would.
:func:`capture_generates` records what an engine pool sends to its engines (the router's here,
serve's in :mod:`tests.scaffold_harness`), for checks against the engine's own ids.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentrl.router.sampling import PROBE_REQUEST_ID
from tests.conftest import free_port

ADMIN, KEY = "admin-secret", "client-key"  # the admin token and a client key of conftest's http_router


class RouterServer:
    def __init__(self, router: Any, port: int, loop: asyncio.AbstractEventLoop) -> None:
        self.router = router
        self.port = port
        self.loop = loop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, coro: Any, timeout: float = 120) -> Any:
        """Run a coroutine on the router's loop (e.g. to inspect or change the pool)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def open_session(self, session_id: str, admin_token: str) -> str:
        """Open a session over the admin API; returns its base URL (``.../sessions/<id>``, without
        ``/v1``)."""
        import requests

        requests.post(self.url + "/admin/sessions", json={"session_id": session_id},
                      headers={"Authorization": f"Bearer {admin_token}"}).raise_for_status()
        return f"{self.url}/sessions/{session_id}"

    def records(self, session_id: str) -> list[dict[str, Any]]:
        """The session's records so far, as dicts."""
        return [r.to_dict() for r in self.router.sessions[session_id].records]


@contextmanager
def serve_router(urls: list[str], model_dir: str, *, api_keys: frozenset[str] = frozenset(),
                 admin_token: str = "", sessions_dir: Path | None = None, retries: int = 1,
                 request_timeout_s: float = 120, health_interval_s: float = 1.0, render: str = "auto",
                 health_failures: int = 1) -> Iterator[RouterServer]:
    from aiohttp import web

    from agentrl.models import eos_token_ids
    from agentrl.router import EnginePool, Router, make_app

    loop = asyncio.new_event_loop()
    port = free_port()
    state: dict[str, Any] = {}

    async def start() -> RouterServer:
        pool = EnginePool(urls, request_timeout_s=request_timeout_s, health_interval_s=health_interval_s,
                          health_failures=health_failures)
        await pool.start()
        router = Router(
            pool,
            model_name="tiny-tools",
            eos_token_ids=eos_token_ids(model_dir),
            max_model_len=2048,
            sessions_dir=sessions_dir,
            retries=retries,
            model_dir=model_dir,
            render=render,
        )
        runner = web.AppRunner(make_app(router, admin_token=admin_token, api_keys=api_keys))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        state["runner"] = runner
        return RouterServer(router, port, loop)

    async def stop() -> None:
        await state["runner"].cleanup()
        await state["server"].router.pool.close()

    thread = threading.Thread(target=loop.run_forever, daemon=True, name="router-test-loop")
    thread.start()
    try:
        state["server"] = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
        yield state["server"]
    finally:
        if "server" in state:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def capture_generates(pool: Any) -> list[tuple[list[int], list[int], list[float]]]:
    """Record every token-in generate ``pool`` (an :class:`~agentrl.router.EnginePool`) sends to an
    engine, streamed or not, as (prompt ids, completion ids, logprobs) in the order they finish;
    returns the live list."""
    real_call, real_stream = pool.call, pool.stream
    got: list[tuple[list[int], list[int], list[float]]] = []

    def lps(ch: dict[str, Any]) -> list[float]:
        return [c["logprob"] for c in ((ch.get("logprobs") or {}).get("content") or [])]

    async def call(engine: Any, path: str, body: dict[str, Any], *a: Any, **kw: Any) -> dict[str, Any]:
        out = await real_call(engine, path, body, *a, **kw)
        if path == "/inference/v1/generate" and body.get("request_id") != PROBE_REQUEST_ID:
            ch = out["choices"][0]
            got.append((ids(body["token_ids"]), ids(ch["token_ids"]), lps(ch)))
        return out

    async def stream(engine: Any, path: str, body: dict[str, Any]) -> Any:
        out: list[int] = []
        lp: list[float] = []
        try:
            async for event in real_stream(engine, path, body):
                for ch in event.get("choices") or []:
                    out.extend(ch.get("token_ids") or [])
                    lp.extend(lps(ch))
                yield event
        finally:
            got.append((ids(body["token_ids"]), ids(out), lp))

    pool.call, pool.stream = call, stream
    return got


def ids(x: Any) -> list[int]:
    return [int(t) for t in x]
