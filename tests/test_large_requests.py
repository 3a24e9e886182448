"""A huge request is bounded before any parsing work: one beyond the body limit is refused while
it is read, one that cannot fit the context is refused before it is parsed (by its length) or
before it is tokenised (by its text), and the router keeps serving everyone else. How long others
wait meanwhile is measured in ``benchmarks/large_body.py``."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from tests.conftest import free_port
from tests.test_router_failover import CHAT, FakeEngine


def _body(chars: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "w" * chars}], "max_tokens": 4}).encode()


def test_huge_prompts_are_refused_early_and_the_router_keeps_serving() -> None:
    from agentrl.router import EnginePool, Router, make_app

    async def go() -> dict[str, object]:
        engine = FakeEngine()
        await engine.start()
        pool = EnginePool([engine.url], request_timeout_s=10)
        await pool.start()
        router = Router(pool, model_name="m", eos_token_ids={2}, max_model_len=64, render="engine")
        runner = web.AppRunner(make_app(router, client_max_size=16 << 20))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        out: dict[str, object] = {}
        try:
            async with aiohttp.ClientSession() as http:
                for name, chars in (
                    ("50MiB", 50 << 20),
                    ("4MiB", 4 << 20),
                    ("too_long", router.max_prompt_chars + 1),
                ):
                    try:
                        async with http.post(
                            url, data=_body(chars), headers={"Content-Type": "application/json"}
                        ) as r:
                            out[name] = (r.status, (await r.json())["error"].get("code"))
                    except aiohttp.ClientError as e:  # a server that closes after refusing a body
                        out[name] = ("closed", type(e).__name__)
                async with http.post(url, json=CHAT) as r:
                    out["small"] = r.status
        finally:
            await runner.cleanup()
            await pool.close()
            await engine.stop()
        out["rendered"] = len(engine.rendered)
        return out

    out = asyncio.run(go())
    assert out["50MiB"] == (400, "context_length_exceeded") or out["50MiB"][0] in (413, "closed"), out
    assert out["4MiB"] == (400, "context_length_exceeded"), out
    assert out["too_long"] == (400, "context_length_exceeded"), out
    assert out["small"] == 200 and out["rendered"] == 1, out  # only the small request was ever rendered
