"""Session ids are names, never paths: an id with a slash, '..', an absolute path, a NUL or 400
characters (in the URL, the session header or a ``sess-`` key) is a 400 before any work is done,
and no call record is written outside ``sessions/``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import quote

import aiohttp
from aiohttp import web

from tests.conftest import free_port
from tests.test_router_failover import CHAT, FakeEngine

BAD = ["..%2F..%2Foutside", "../outside", "%2Ftmp%2Foutside-abs", "x" * 400, "a\x00b", ".."]


def test_hostile_session_ids_are_refused_before_any_generation(tmp_path: Path) -> None:
    from agentrl.router import EnginePool, Router, make_app

    sessions = tmp_path / "run" / "sessions"

    async def go() -> dict[str, list[int]]:
        engine = FakeEngine()
        await engine.start()
        pool = EnginePool([engine.url], request_timeout_s=10)
        await pool.start()
        router = Router(pool, model_name="m", eos_token_ids={2}, max_model_len=64, render="engine",
                        sessions_dir=sessions)
        runner = web.AppRunner(make_app(router))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        base = f"http://127.0.0.1:{port}"
        codes: dict[str, list[int]] = {"path": [], "header": [], "key": []}
        try:
            async with aiohttp.ClientSession() as http:
                for sid in BAD:
                    if sid == "..":  # in a URL path the client itself resolves it away (no session at all)
                        continue
                    url = f"{base}/sessions/{sid if '%' in sid else quote(sid, safe='')}/v1/chat/completions"
                    async with http.post(url, json=CHAT) as r:
                        codes["path"].append(r.status)
                    raw = sid.replace("%2F", "/")
                    if "\x00" not in raw:  # aiohttp will not send a NUL in a header; the path case covers it
                        async with http.post(f"{base}/v1/chat/completions", json=CHAT,
                                             headers={"X-Agentrl-Session": raw}) as r:
                            codes["header"].append(r.status)
                        async with http.post(f"{base}/v1/chat/completions", json=CHAT,
                                             headers={"Authorization": f"Bearer sess-{raw}"}) as r:
                            codes["key"].append(r.status)
                async with http.post(f"{base}/sessions/fine-id.1/v1/chat/completions", json=CHAT) as r:
                    codes["fine"] = [r.status]
        finally:
            await runner.cleanup()
            await pool.close()
            await engine.stop()
        codes["generated"] = [engine.calls]
        return codes

    codes = asyncio.run(go())
    assert set(codes["path"]) == {400}, codes
    assert set(codes["header"]) == {400} and set(codes["key"]) == {400}, codes
    assert codes["fine"] == [200] and codes["generated"] == [1]  # only the good id reached the engine
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.jsonl"))
    assert written == ["run/sessions/fine-id.1.jsonl"], written
