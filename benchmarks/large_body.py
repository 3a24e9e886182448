"""A huge request must not stall everyone else: small requests' latency while serve's router rejects
a 50 MiB (and a 4 MiB) valid chat prompt.

The router runs in its own process with the tiny-tools tokenizer and template (the local render)
in front of the stand-in engine of ``router_overhead.py``; a client sends small chat completions one
after another and records their latency, first alone (baseline), then while another client posts
a 50 MiB prompt (beyond ``router.max_body_mb``: refused while its body is read) and a 4 MiB prompt
(within the body limit, beyond what the context can hold: refused before it is tokenised) again
and again. Prints a final JSON line with the p50/p99 of the small requests in each phase, the big
requests' statuses, and the load average (the machine is shared).

    python benchmarks/large_body.py [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import aiohttp
from common import free_port, percentile  # benchmarks/common.py
from router_overhead import BODY, _run_standin, router_app

ROOT = Path(__file__).resolve().parents[1]


def _run_router(port: int, engine_port: int, model_dir: str) -> None:
    sys.path.insert(0, str(ROOT))
    from aiohttp import web

    # serve's max_body_mb
    app = router_app(engine_port, model_dir, max_model_len=2048, client_max_size=16 << 20)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def _small(url: str, seconds: float) -> list[float]:
    out: list[float] = []
    async with aiohttp.ClientSession() as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            async with http.post(url, json=BODY) as r:
                await r.read()
                assert r.status == 200, r.status
            out.append((time.perf_counter() - t0) * 1e3)
    return out


async def _big(url: str, megabytes: float, stop: asyncio.Event) -> list[int]:
    text = "word " * int(megabytes * (1 << 20) / 5)
    payload = json.dumps(
        {"model": "stand-in", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    )
    statuses: list[int] = []
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            try:
                async with http.post(url, data=payload, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    statuses.append(r.status)
            except aiohttp.ClientError:  # the server may close a connection whose body it refused
                statuses.append(413)
    return statuses


def _big_sender(url: str, megabytes: float, seconds: float, out: mp.Queue) -> None:
    """The big requests, from a process of their own (sending 50 MiB would stall the small client's loop)."""
    async def go() -> list[int]:
        stop = asyncio.Event()
        task = asyncio.create_task(_big(url, megabytes, stop))
        await asyncio.sleep(seconds)
        stop.set()
        return await task

    out.put(asyncio.run(go()))


def _phase(url: str, seconds: float, megabytes: float | None) -> tuple[list[float], list[int]]:
    if not megabytes:
        return asyncio.run(_small(url, seconds)), []
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    sender = ctx.Process(target=_big_sender, args=(url, megabytes, seconds + 1.0, queue), daemon=True)
    sender.start()
    time.sleep(1.0)  # its first big body is on the wire
    small = asyncio.run(_small(url, seconds))
    statuses = queue.get(timeout=300)
    sender.join(30)
    return small, statuses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=6.0)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from agentrl.models import resolve_model

    model_dir = resolve_model("tiny-tools")
    engine_port, port = free_port(), free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_run_standin, args=(engine_port,), daemon=True),
             ctx.Process(target=_run_router, args=(port, engine_port, model_dir), daemon=True)]
    for proc in procs:
        proc.start()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        async def wait() -> None:
            async with aiohttp.ClientSession() as http:
                for _ in range(600):
                    try:
                        async with http.post(url, json=BODY) as r:
                            if r.status == 200:
                                return
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.2)
            raise SystemExit("the router did not come up")

        asyncio.run(wait())
        results = {}
        for name, mb in (("baseline", None), ("during_50mib", 50.0), ("during_4mib", 4.0)):
            small, statuses = _phase(url, args.seconds, mb)
            results[name] = (small, statuses)
    finally:
        for proc in procs:
            proc.terminate()
            proc.join(10)
    out = {"benchmark": "large_body"}
    for name, (small, statuses) in results.items():
        out[f"small_p50_ms_{name}"] = round(percentile(small, 0.5), 2)
        out[f"small_p99_ms_{name}"] = round(percentile(small, 0.99), 2)
        out[f"small_requests_{name}"] = len(small)
        if statuses:
            out[f"big_statuses_{name}"] = sorted(set(statuses))
            out[f"big_requests_{name}"] = len(statuses)
    out["load_avg"] = round(os.getloadavg()[0], 2)
    sys.stderr.flush()  # the router child's exit lines (nanobind) end without a newline
    sys.stdout.write("\n" + json.dumps(out) + "\n")  # on a line of its own whatever a child printed
    sys.stdout.flush()


if __name__ == "__main__":
    main()
