"""Rollout workers on other machines send their episode lines to serve's ``episodes.jsonl``
(``EpisodeUploader`` -> ``POST /admin/episodes``), over real loopback HTTP; nothing is lost while
serve is away."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

from agentrl.rollout.remote import EpisodeUploader, episode_log_route
from agentrl.router.server import ADMIN_TOKEN, errors_middleware, require_admin
from tests.conftest import free_port


async def _serve(path: Path, port: int, token: str = "tok") -> web.AppRunner:
    app = web.Application(middlewares=[errors_middleware])  # as in serve: errors become their status
    app[ADMIN_TOKEN] = token
    app.router.add_post("/admin/episodes", episode_log_route(path, require_admin))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_lines_sent_while_serve_is_away_arrive_once_it_is_back_in_order_and_once(tmp_path: Path) -> None:
    log = tmp_path / "episodes.jsonl"
    port = free_port()

    async def go() -> None:
        up = EpisodeUploader(f"http://127.0.0.1:{port}", "tok", timeout_s=5)
        try:
            up.add({"worker": "w0", "n": 0})
            assert not await up.flush() and up.pending == [{"worker": "w0", "n": 0}]  # nobody listening: kept
            runner = await _serve(log, port)
            try:
                up.add({"worker": "w0", "n": 1})
                assert await up.flush() and up.pending == [] and up.sent == 2
                assert await up.flush()  # nothing pending: nothing sent again
                up.add({"worker": "w1", "n": 2})
            finally:
                await up.close()  # the last flush goes out before the client closes
                await runner.cleanup()
        finally:
            await up.close()

    asyncio.run(go())
    assert [x["n"] for x in _lines(log)] == [0, 1, 2]


def test_the_route_wants_the_admin_token_and_a_list_of_objects(tmp_path: Path) -> None:
    log = tmp_path / "episodes.jsonl"
    port = free_port()

    async def go() -> None:
        import aiohttp

        runner = await _serve(log, port)
        try:
            url = f"http://127.0.0.1:{port}/admin/episodes"
            async with aiohttp.ClientSession() as http:
                async with http.post(url, json={"episodes": [{}]}) as r:
                    assert r.status == 401
                auth = {"Authorization": "Bearer tok"}
                for bad in ({"episodes": [1, 2]}, {"lines": []}, [1]):
                    async with http.post(url, json=bad, headers=auth) as r:
                        assert r.status == 400 and "episodes" in await r.text()
            wrong = EpisodeUploader(f"http://127.0.0.1:{port}", "not-the-token")
            wrong.add({"n": 1})
            assert not await wrong.flush() and len(wrong.pending) == 1  # refused: kept, not lost
            await wrong.close()
        finally:
            await runner.cleanup()

    asyncio.run(go())
    assert _lines(log) == []


def test_past_its_bound_the_uploader_drops_the_oldest_lines_and_counts_them() -> None:
    up = EpisodeUploader("http://127.0.0.1:9", "", max_lines=3)
    for n in range(5):
        up.add({"n": n})
    assert [x["n"] for x in up.pending] == [2, 3, 4] and up.dropped == 2
