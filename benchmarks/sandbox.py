"""Sandbox benchmark: cold start, warm acquire, fast exec vs `docker exec`, and leaks.

Usage: python benchmarks/sandbox.py [--backend docker|bubblewrap] [--n 200]
Prints progress, then one final JSON line with cold_start_p50_ms, cold_start_p99_ms,
warm_acquire_p50_ms, warm_acquire_p99_ms, exec_p50_ms, exec_p99_ms, reset_p50_ms, reset_p99_ms
(from an episode's end until its box is back in the pool: the agent's reset, which kills, removes
IPC objects and wipes the writable mounts), docker_exec_p50_ms (the plain `docker exec` CLI
baseline, same run, same container), exec_speedup and leaked_containers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
import uuid

from agentrl.sandbox import SandboxConfig, SandboxPool


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 2)


async def main(backend: str, n: int) -> dict:
    instance = f"bench-{uuid.uuid4().hex[:8]}"
    cfg = SandboxConfig(backend=backend, warm=4, max_concurrency=8)  # type: ignore[arg-type]
    pool = SandboxPool(cfg, instance)
    await pool.start()
    try:
        # Cold start: creation until the agent answers, one at a time.
        cold = []
        for _ in range(max(10, n // 10)):
            t0 = time.perf_counter()
            slot = await pool.backend.create()  # type: ignore[union-attr]
            cold.append(time.perf_counter() - t0)
            await pool.backend.destroy(slot)  # type: ignore[union-attr]
        print(f"cold start p50 {pct(cold, .5)} ms", flush=True)

        # Warm acquire: a box is waiting (reset boxes come back between episodes).
        warm, execs, resets = [], [], []
        sid = ""
        for i in range(n):
            t0 = time.perf_counter()
            await pool.wait_idle()
            if i:
                resets.append(time.perf_counter() - t0)  # the previous episode's reset
            t0 = time.perf_counter()
            async with pool.acquire() as sb:
                warm.append(time.perf_counter() - t0)
                sid = sb.id
                t1 = time.perf_counter()
                r = await sb.exec(["true"])
                execs.append(time.perf_counter() - t1)
                assert r.ok
        print(f"warm acquire p50 {pct(warm, .5)} ms, exec p50 {pct(execs, .5)} ms, "
              f"reset p50 {pct(resets, .5)} ms", flush=True)

        docker_exec = []
        if backend == "docker":
            async with pool.acquire() as sb:
                sid = sb.id
                for _ in range(min(n, 50)):
                    t0 = time.perf_counter()
                    subprocess.run(["docker", "exec", sid, "true"], check=True)
                    docker_exec.append(time.perf_counter() - t0)
            print(f"docker exec p50 {pct(docker_exec, .5)} ms", flush=True)
    finally:
        await pool.close()
    leaked = len(await pool.live_ids())
    if backend == "docker":
        out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.instance={instance}"],
                             capture_output=True, text=True)
        leaked = max(leaked, len(out.stdout.split()))
    result = {
        "backend": backend,
        "cold_start_p50_ms": pct(cold, .5), "cold_start_p99_ms": pct(cold, .99),
        "warm_acquire_p50_ms": pct(warm, .5), "warm_acquire_p99_ms": pct(warm, .99),
        "exec_p50_ms": pct(execs, .5), "exec_p99_ms": pct(execs, .99),
        "reset_p50_ms": pct(resets, .5), "reset_p99_ms": pct(resets, .99),
        "docker_exec_p50_ms": pct(docker_exec, .5) if docker_exec else None,
        "leaked_containers": leaked,
    }
    if docker_exec:
        result["exec_speedup"] = round(result["docker_exec_p50_ms"] / result["exec_p50_ms"], 1)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="docker", choices=["docker", "bubblewrap"])
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.backend, args.n))))
