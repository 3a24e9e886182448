"""One bearer parsing and one error shape for serve's admin and buffer routes: the scheme is
case-insensitive everywhere (RFC 7235), a wrong or missing token is a 401 in the same JSON shape."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from agentrl.buffer import Buffer, BufferConfig, add_buffer_routes
from tests.conftest import free_port
from tests.test_router_failover import FakeEngine

TOKEN = "admin-token-for-the-test"


def test_every_admin_and_buffer_route_reads_the_bearer_the_same_way() -> None:
    from agentrl.router import EnginePool, Router, make_app

    async def go() -> list[tuple[str, str, int, bool]]:
        engine = FakeEngine()
        await engine.start()
        pool = EnginePool([engine.url], request_timeout_s=10)
        await pool.start()
        router = Router(pool, model_name="m", eos_token_ids={2}, max_model_len=64, render="engine")
        app = make_app(router, admin_token=TOKEN)
        buf = Buffer(BufferConfig(batch_size=1))
        add_buffer_routes(app, buf, TOKEN)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        base = f"http://127.0.0.1:{port}"
        rows = []
        try:
            async with aiohttp.ClientSession() as http:
                for method, path in [
                    ("GET", "/buffer/stats"),
                    ("POST", "/buffer/release"),
                    ("GET", "/admin/engines"),
                    ("POST", "/admin/sessions"),
                ]:
                    for auth in (f"bearer {TOKEN}", f"BEARER {TOKEN}", "Bearer wrong", None):
                        headers = {"Authorization": auth} if auth else {}
                        async with http.request(method, base + path, headers=headers, json={}) as r:
                            body = await r.json(content_type=None)
                            shaped = r.status != 401 or set(body.get("error") or {}) >= {"message", "type"}
                            rows.append((path, str(auth), r.status, shaped))
        finally:
            await runner.cleanup()
            await pool.close()
            await engine.stop()
            buf.close()
        return rows

    rows = asyncio.run(go())
    for path, auth, status, shaped in rows:
        good = auth.lower() == f"bearer {TOKEN}".lower()
        assert (status == 200) == good and (status == 401) == (not good), (path, auth, status)
        assert shaped, (path, auth, status)
