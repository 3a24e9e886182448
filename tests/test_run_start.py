"""``agentrl run`` waiting for its serve child: a model being prepared (a first build takes many
minutes) is not counted against the start-up bound; anything else is."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from agentrl.cli.run import wait_for_serve
from agentrl.web import start_on_loopback


class Child:
    returncode = None

    def poll(self) -> int | None:
        return None


def _health_server(phases: list[tuple[float, str]]) -> Iterator[str]:
    """A stand-in serve whose /health answers 503 with each (seconds, phase) in turn, then 200."""
    loop = asyncio.new_event_loop()
    started = time.monotonic()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def health(request: web.Request) -> web.Response:
        t = time.monotonic() - started
        for until, phase in phases:
            if t < until:
                return web.json_response({"status": "starting", "phase": phase, "elapsed_s": t}, status=503)
        return web.json_response({"status": "ok"})

    async def start() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        box["runner"], box["url"] = await start_on_loopback(app)
        ready.set()

    thread = threading.Thread(
        target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True
    )
    thread.start()
    ready.wait(10)
    try:
        yield box["url"]
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_a_model_being_prepared_does_not_count_against_the_start_bound() -> None:
    gen = _health_server([(4.0, "preparing the model tiny-agent"), (5.0, "starting 1 engine(s)")])
    url = next(gen)
    try:
        t0 = time.monotonic()
        wait_for_serve(url, Child(), timeout_s=2.5)  # 4 s preparing, then 1 s starting: within the bound
        assert time.monotonic() - t0 >= 4.0
    finally:
        next(gen, None)


def test_a_start_that_outlasts_the_bound_after_the_model_is_ready_fails_with_a_clear_message() -> None:
    gen = _health_server([(1.0, "preparing the model tiny-agent"), (60.0, "starting 1 engine(s)")])
    url = next(gen)
    try:
        with pytest.raises(SystemExit, match="not healthy within 2 s"):
            wait_for_serve(url, Child(), timeout_s=2.0)
    finally:
        next(gen, None)
