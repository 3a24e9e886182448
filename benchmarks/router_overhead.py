"""What the router adds per completion: direct-to-engine against through-the-router, capture on.

A fast stand-in engine (this file's own aiohttp app, in a child process) answers vLLM's render,
token-in generate and derender routes and its plain chat route with canned token ids, so the
engine is never the bottleneck. The router runs in a second child process with a session per
client (capture on: every call recorded). The load generator runs here. At each concurrency the
same number of completions is sent direct (one plain chat call to the stand-in) and through the
router (which does render + generate + derender on the stand-in). Prints a final JSON line.

    python benchmarks/router_overhead.py [--requests 3000] [--concurrency 1,64,1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

log = logging.getLogger("router_overhead")

PROMPT = [1, 297, 201, 74, 75, 2, 201, 1, 298, 201]
OUTPUT = [19, 25, 31, 40, 2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _choice_tokens(i: int) -> dict[str, Any]:
    return {"index": i, "finish_reason": "stop", "stop_reason": None, "token_ids": OUTPUT,
            "weight_versions": [{"version": "0", "start": 0, "end": len(OUTPUT)}],
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in OUTPUT]}}


def _chat_response(n: int) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "stand-in",
            "choices": [{"index": i, "message": {"role": "assistant", "content": "17"}, "finish_reason": "stop",
                         "logprobs": None} for i in range(n)],
            "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": len(OUTPUT) * n,
                      "total_tokens": len(PROMPT) + len(OUTPUT) * n}}


def standin_app() -> web.Application:
    async def render(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"request_id": "r", "token_ids": PROMPT, "model": "stand-in",
                                  "sampling_params": {"n": body.get("n", 1), "max_tokens": body.get("max_tokens"),
                                                      "logprobs": 0}})

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        n = body.get("sampling_params", {}).get("n", 1)
        return web.json_response({"request_id": "g", "choices": [_choice_tokens(i) for i in range(n)]})

    async def derender(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(_chat_response(len(body["generate_response"]["choices"])))

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(_chat_response(body.get("n", 1)))

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions/render", render)
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_post("/v1/chat/completions/derender", derender)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", ok)
    app.router.add_post("/update_weight_version", ok)
    return app


def _run_standin(port: int) -> None:
    web.run_app(standin_app(), host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


def _run_router(port: int, engine_port: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from agentrl.router import EnginePool, Router, make_app

    async def build() -> web.Application:
        pool = EnginePool([f"http://127.0.0.1:{engine_port}"], health_interval_s=5)
        await pool.start()
        router = Router(pool, model_name="stand-in", eos_token_ids={2}, max_model_len=4096)
        return make_app(router)

    web.run_app(build(), host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


async def _wait(url: str) -> None:
    async with ClientSession() as http:
        for _ in range(200):
            try:
                async with http.get(url + "/health") as r:
                    if r.status in (200, 503):
                        return
            except OSError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


async def _load(url: str, concurrency: int, total: int, session: bool) -> tuple[list[float], float]:
    latencies: list[float] = []
    body = {"model": "stand-in", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    counter = iter(range(total))
    async with ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=120)) as http:
        async def worker(w: int) -> None:
            headers = {"X-Agentrl-Session": f"bench-{w}"} if session else {}
            for _ in counter:
                t0 = time.perf_counter()
                async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url} answered {r.status}")
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return latencies, time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def bench(requests: int, levels: list[int]) -> dict[str, Any]:
    engine_port, router_port = _port(), _port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_run_standin, args=(engine_port,), daemon=True),
             ctx.Process(target=_run_router, args=(router_port, engine_port), daemon=True)]
    for p in procs:
        p.start()
    direct_url, router_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{router_port}"
    try:
        await _wait(direct_url)
        await _wait(router_url)
        await _load(direct_url, 8, 200, False)  # warm both up
        await _load(router_url, 8, 200, True)
        results: dict[str, Any] = {}
        for c in levels:
            n = max(requests, 2 * c) if c > 1 else min(requests, 1000)
            d_lat, d_wall = await _load(direct_url, c, n, False)
            r_lat, r_wall = await _load(router_url, c, n, True)
            results[str(c)] = {
                "requests": n,
                "direct_p50_ms": 1000 * statistics.median(d_lat), "direct_p99_ms": 1000 * _pct(d_lat, 0.99),
                "router_p50_ms": 1000 * statistics.median(r_lat), "router_p99_ms": 1000 * _pct(r_lat, 0.99),
                "direct_req_per_s": n / d_wall, "router_req_per_s": n / r_wall,
            }
            log.info("concurrency %d: %s", c, json.dumps(results[str(c)]))
        one = results[str(levels[0])]
        best = max(results.values(), key=lambda x: x["router_req_per_s"])
        return {
            "benchmark": "router_overhead", "engine": "stand-in (render/generate/derender, canned ids)",
            "capture": True, "engine_calls_per_completion": 3, "levels": results,
            "added_latency_p50_ms": round(one["router_p50_ms"] - one["direct_p50_ms"], 3),
            "added_latency_p99_ms": round(one["router_p99_ms"] - one["direct_p99_ms"], 3),
            "router_req_per_s": round(best["router_req_per_s"], 1),
            "direct_req_per_s": round(max(x["direct_req_per_s"] for x in results.values()), 1),
        }
    finally:
        for p in procs:
            p.terminate()
            p.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", default="1,64,1024")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    result = asyncio.run(bench(args.requests, [int(x) for x in args.concurrency.split(",")]))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
