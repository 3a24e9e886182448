"""What the router adds per completion: direct-to-engine against through-the-router, capture on.

Three kinds of child process, so none of them is measured inside another's event loop:

- a fast stand-in engine: a minimal HTTP/1.1 server (asyncio protocol, keep-alive) answering
  vLLM's token-in generate route (what the router calls, once per completion), the plain chat
  route (what a direct call uses), and render/derender (the fallback routes) with canned ids;
- the router: the real ``agentrl.router`` app (aiohttp) with a session per client (capture on:
  every call recorded with exact ids, logprobs and versions) over that engine, rendering and
  derendering locally with the tiny-tools tokenizer and chat template. Its calibration against
  an engine is skipped here (the stand-in has no template); tests/test_router_render.py checks
  the local renderer against real vLLM;
- load generators: a minimal keep-alive HTTP client, several processes at high concurrency, so
  that the load side is not the bottleneck.

At each concurrency the same number of completions is sent direct and through the router, on
each of the router's three dialects (``--routes``): chat completions, the Responses API
(``/v1/responses``, each response stored for ``previous_response_id``) and the Messages API
(``/v1/messages``); all three run as chat calls on the same capture path, so the difference
between them is the translation. Besides wall-clock rates it reports the router's CPU seconds
per completion (meaningful on a shared machine) and the load average. Prints a final JSON line:
the chat figures under their old names, and ``<route>_added_p50_ms`` / ``<route>_req_per_s`` per route.

    python benchmarks/router_overhead.py [--requests 6000] [--concurrency 1,64,1024] [--routes
    chat,responses,messages]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("router_overhead")

PROMPT = [1, 297, 201, 74, 75, 2, 201, 1, 298, 201]
OUTPUT = [19, 25, 31, 40, 2]
EPISODE_CALLS = 8  # calls per session before a client opens a new one
BODY = {"model": "stand-in", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
# The same call in each dialect the router speaks: (path, body).
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", BODY),
    "responses": ("/v1/responses", {"model": "stand-in", "input": "hi", "max_output_tokens": 8}),
    "messages": (
        "/v1/messages",
        {"model": "stand-in", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    ),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the stand-in engine -------------------------------------------------------------------------------
def _choice_tokens(i: int) -> dict[str, Any]:
    return {"index": i, "finish_reason": "stop", "stop_reason": None, "token_ids": OUTPUT,
            "weight_versions": [{"version": "0", "start": 0, "end": len(OUTPUT)}],
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in OUTPUT]}}


def _chat_response(n: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 0,
        "model": "stand-in",
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": "17"},
                "finish_reason": "stop",
                "logprobs": None,
            }
            for i in range(n)
        ],
        "usage": {
            "prompt_tokens": len(PROMPT),
            "completion_tokens": len(OUTPUT) * n,
            "total_tokens": len(PROMPT) + len(OUTPUT) * n,
        },
    }


def _standin_answer(path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    if path == "/inference/v1/generate":
        n = (body.get("sampling_params") or {}).get("n", 1)
        return 200, json.dumps({"request_id": body.get("request_id", "g"),
                                "choices": [_choice_tokens(i) for i in range(n)]}).encode()
    if path == "/v1/chat/completions":
        return 200, json.dumps(_chat_response(body.get("n", 1))).encode()
    if path == "/v1/chat/completions/render":
        return 200, json.dumps(
            {
                "request_id": "r",
                "token_ids": PROMPT,
                "model": "stand-in",
                "sampling_params": {
                    "n": body.get("n", 1),
                    "max_tokens": body.get("max_tokens"),
                    "logprobs": 0,
                },
            }
        ).encode()
    if path == "/v1/chat/completions/derender":
        return 200, json.dumps(_chat_response(len(body["generate_response"]["choices"]))).encode()
    if path in ("/health", "/update_weight_version"):
        return 200, b"{}"
    if path == "/v1/models":
        return 200, json.dumps({"data": [{"id": "stand-in"}]}).encode()
    return 404, b'{"error": {"message": "not found"}}'


class _StandinProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and Content-Length bodies: all a benchmark client and aiohttp send."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            if len(self.buf) < end + 4 + length:
                return
            raw = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            path = head[0].split(" ")[1].split("?")[0]
            status, out = _standin_answer(path, json.loads(raw) if raw else {})
            self.transport.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                                 b"\r\n"
                                 % (status, len(out)) + out)


def _run_standin(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(
            _StandinProtocol, "127.0.0.1", port, backlog=4096
        )
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the router ----------------------------------------------------------------------------------------
async def router_app(engine_port: int, model_dir: str, max_model_len: int = 4096, **app_args: Any) -> Any:
    """The real router's app in front of the stand-in engine, set up as serve sets it up (in the
    router's own process: ``sys.path`` holds the repository)."""
    from agentrl.router import EnginePool, Router, make_app
    from agentrl.serve import settle_gc

    pool = EnginePool([f"http://127.0.0.1:{engine_port}"], health_interval_s=5)
    await pool.start()
    router = Router(
        pool, model_name="stand-in", eos_token_ids={2}, max_model_len=max_model_len, model_dir=model_dir
    )
    if router.local is not None:
        router.local.state = "on"  # the stand-in has no chat template to calibrate against
    settle_gc()  # as serve does once it is up
    return make_app(router, **app_args)


def _run_router(port: int, engine_port: int, model_dir: str, use_uvloop: bool, profile: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from aiohttp import web

    if use_uvloop:
        import uvloop

        uvloop.install()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile(time.process_time)  # CPU time: the machine is shared
        prof.enable()
    web.run_app(router_app(engine_port, model_dir), host="127.0.0.1", port=port, print=None, access_log=None,
                backlog=4096)
    if prof is not None:  # run_app returns on SIGTERM
        prof.disable()
        prof.dump_stats(profile)


# -- load generators -----------------------------------------------------------------------------------
async def _client(
    port: int, workers: int, total: int, session: str, start_at: float, route: str
) -> list[float]:
    """``workers`` keep-alive connections sending ``total`` completions (``route``'s dialect) between them."""
    path, body = ROUTES[route]
    payload = json.dumps(body).encode()
    counter = iter(range(total))
    latencies: list[float] = []

    def request(w: int, i: int) -> bytes:
        # A client's calls go to a session of EPISODE_CALLS calls, then a new one (like episodes).
        extra = f"X-Agentrl-Session: {session}-{w}-{i // EPISODE_CALLS}\r\n" if session else ""
        return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"{extra}Content-Length: {len(payload)}\r\n\r\n").encode() + payload

    async def worker(w: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i, _ in enumerate(counter):
                req = request(w, i)
                t0 = time.perf_counter()
                writer.write(req)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                if status != 200:
                    raise RuntimeError(f"port {port} answered {status}")
                latencies.append(time.perf_counter() - t0)
        finally:
            writer.close()

    await asyncio.sleep(max(0.0, start_at - time.time()))
    await asyncio.gather(*(worker(w) for w in range(workers)))
    return latencies


def _run_client(
    port: int, workers: int, total: int, session: str, start_at: float, route: str, q: Any
) -> None:
    try:
        q.put(("ok", asyncio.run(_client(port, workers, total, session, start_at, route)), time.time()))
    except Exception as e:
        q.put(("error", f"{type(e).__name__}: {e}", time.time()))


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _load(port: int, concurrency: int, total: int, session: str, procs: int, cpu_pid: int | None,
          route: str = "chat") -> tuple[list[float], float, float]:
    """Run ``total`` calls at ``concurrency`` from ``procs`` processes: (latencies, wall s, cpu s of
    cpu_pid)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = max(1, min(procs, concurrency))
    start_at = time.time() + 1.5  # every generator has started (spawn) and connects at once
    children = []
    for i in range(procs):
        workers = concurrency // procs + (1 if i < concurrency % procs else 0)
        share = total // procs + (1 if i < total % procs else 0)
        children.append(
            ctx.Process(
                target=_run_client,
                args=(port, workers, share, f"{session}{i}" if session else "", start_at, route, q),
                daemon=True,
            )
        )
    for c in children:
        c.start()
    while time.time() < start_at:
        time.sleep(0.01)
    cpu0 = _cpu_s(cpu_pid) if cpu_pid else 0.0
    latencies: list[float] = []
    end = start_at
    for _ in children:
        kind, value, t_end = q.get(timeout=600)
        if kind != "ok":
            raise RuntimeError(value)
        latencies += value
        end = max(end, t_end)
    cpu = (_cpu_s(cpu_pid) - cpu0) if cpu_pid else 0.0
    for c in children:
        c.join(10)
    return latencies, end - start_at, cpu


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _wait(port: int) -> None:
    for _ in range(2400):  # two minutes: importing the router and loading a tokenizer on a busy machine
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


def bench(requests: int, levels: list[int], procs: int, use_uvloop: bool, profile: str,
          routes: list[str] | None = None) -> dict[str, Any]:
    from agentrl.models import resolve_model

    routes = routes or ["chat"]
    model_dir = resolve_model("tiny-tools")  # its tokenizer and chat template: the local render's work
    engine_port, router_port = _port(), _port()
    ctx = mp.get_context("spawn")
    engine = ctx.Process(target=_run_standin, args=(engine_port,), daemon=True)
    router = ctx.Process(target=_run_router, args=(router_port, engine_port, model_dir, use_uvloop, profile),
                         daemon=True)
    engine.start()
    router.start()
    try:
        _wait(engine_port)
        _wait(router_port)
        time.sleep(1.0)
        _load(engine_port, 8, 400, "", 1, None)  # warm both up (connections, template cache)
        for route in routes:
            _load(router_port, 8, 400, f"warm-{route}", 1, None, route)
        per_route: dict[str, dict[str, Any]] = {r: {} for r in routes}
        for c in levels:
            n = min(requests, 1000) if c == 1 else max(requests, 4 * c)
            p = 1 if c == 1 else procs
            d_lat, d_wall, _ = _load(engine_port, c, n, "", p, None)
            for route in routes:  # the same direct calls are every route's baseline
                r_lat, r_wall, r_cpu = _load(router_port, c, n, f"bench{c}-{route}-", p, router.pid, route)
                per_route[route][str(c)] = {
                    "requests": n, "load_generators": p,
                    "direct_p50_ms": round(1000 * statistics.median(d_lat), 3),
                    "direct_p99_ms": round(1000 * _pct(d_lat, 0.99), 3),
                    "router_p50_ms": round(1000 * statistics.median(r_lat), 3),
                    "router_p99_ms": round(1000 * _pct(r_lat, 0.99), 3),
                    "direct_req_per_s": round(n / d_wall, 1), "router_req_per_s": round(n / r_wall, 1),
                    "router_cpu_ms_per_req": round(1000 * r_cpu / n, 3),
                    "router_req_per_cpu_s": round(n / r_cpu, 1) if r_cpu else None,
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }
                log.info("%s at concurrency %d: %s", route, c, json.dumps(per_route[route][str(c)]))
        out: dict[str, Any] = {
            "benchmark": "router_overhead", "engine": "stand-in (token-in generate, canned ids)",
            "capture": True, "render": "local", "engine_calls_per_completion": 1,
            "loop": "uvloop" if use_uvloop else "asyncio", "routes": per_route,
        }
        for route, results in per_route.items():
            one = results[str(levels[0])]
            out[f"{route}_added_p50_ms"] = round(one["router_p50_ms"] - one["direct_p50_ms"], 3)
            out[f"{route}_added_p99_ms"] = round(one["router_p99_ms"] - one["direct_p99_ms"], 3)
            out[f"{route}_req_per_s"] = max(x["router_req_per_s"] for x in results.values())
            out[f"{route}_req_per_cpu_s"] = max(x["router_req_per_cpu_s"] or 0 for x in results.values())
        first = per_route[routes[0]]  # the keys from before routes: the first route's (chat's) figures
        one = first[str(levels[0])]
        out.update({
            "levels": first,
            "added_latency_p50_ms": round(one["router_p50_ms"] - one["direct_p50_ms"], 3),
            "added_latency_p99_ms": round(one["router_p99_ms"] - one["direct_p99_ms"], 3),
            "router_req_per_s": max(x["router_req_per_s"] for x in first.values()),
            "direct_req_per_s": max(x["direct_req_per_s"] for x in first.values()),
            "router_req_per_cpu_s": max(x["router_req_per_cpu_s"] or 0 for x in first.values()),
            "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
        })
        return out
    finally:
        for p in (router, engine):
            p.terminate()
            p.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6000, help="completions per level "
                                                               "(1,000 at concurrency 1)")
    ap.add_argument("--concurrency", default="1,64,1024")
    ap.add_argument(
        "--loadgen-procs", type=int, default=2, help="load-generator processes at concurrency > 1"
    )
    ap.add_argument("--uvloop", action="store_true", help="run the router on uvloop")
    ap.add_argument("--profile", default="", help="write the router's cProfile stats here")
    ap.add_argument("--routes", default="chat,responses,messages", help="the dialects to measure, chat first")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    routes = [r for r in args.routes.split(",") if r]
    unknown = set(routes) - set(ROUTES)
    if unknown:
        ap.error(f"unknown routes {sorted(unknown)}; known: {sorted(ROUTES)}")
    result = bench(
        args.requests,
        [int(x) for x in args.concurrency.split(",")],
        args.loadgen_procs,
        args.uvloop,
        args.profile,
        routes,
    )
    sys.stdout.flush()
    sys.stdout.write("\n" + json.dumps(result) + "\n")  # on a line of its own whatever a child printed


if __name__ == "__main__":
    main()
