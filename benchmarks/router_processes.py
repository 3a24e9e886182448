"""serve's public endpoint as N router processes (``router.processes``): what N buys external scaffolds.

Each configuration is a whole ``agentrl serve`` (``endpoint_only``: no rollout of its own, only the
endpoint) in front of one stand-in engine (:mod:`agentrl.engines.standin`, fast enough not to be
what is measured), driven by ``--clients`` load-generator processes, each holding ``--sessions``
external sessions open at once as an agent framework does: open a session (``POST /admin/sessions``),
make ``--calls`` chained chat calls through its ``base_url`` (each call's messages the previous
ones plus the reply and a new user turn, so each is a continuation the router captures exactly),
close it, open the next. Half the sessions bring an id of their own, the others take the id the
process that opened them makes up (one it owns). Clients keep their connections (HTTP keep-alive,
as SDKs do): the kernel hands each new connection to whichever process accepts it, so a call can
arrive at a process that does not own its session and is passed on to the owner
(``forwarded_share``).

The configurations run one after another in the same run, everything else equal:
``router_processes`` (default ``1,2``). For each, after ``--warmup`` seconds, ``--duration`` seconds
are counted: chat calls completed (what the clients saw answered 200), the CPU seconds of serve and
its router children (``/proc``), the load generators' and the engine's, and each process's
``forwarded`` counter.

On this 2-core machine the clients and the engine share the cores with the routers, so the ratio
says how much of one process's ceiling was the router process, not how a many-core host scales.
Final JSON line: ``router_processes``, ``completions_per_s`` (per configuration),
``completions_per_s_one_process``, ``ratio`` (the most processes against one),
``cpu_ms_per_completion`` (serve and its children, per configuration), ``forwarded_share``,
``errors``, ``configs`` (every figure), ``wall_s``.

    .venv/bin/python benchmarks/router_processes.py [--router-processes 1,2] [--clients 2]
        [--sessions 64] [--calls 3] [--duration 20] [--warmup 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import cpu_s, descendants, free_port, start_standins, tied_to_this_process  # noqa: E402

from agentrl.client import get_json  # noqa: E402
from agentrl.procs import die_with_parent  # noqa: E402


def serve_config(path: Path, run_dir: Path, port: int, url: str, processes: int) -> None:
    path.write_text(f"""model = "tiny-tools"
run_dir = "{run_dir}"
endpoint_only = true
[engine]
urls = ["{url}"]
max_model_len = 2048
[router]
port = {port}
processes = {processes}
""")


# -- a load generator (its own process) ------------------------------------------------------------
async def _client(base: str, token: str, sessions: int, calls: int, max_tokens: int, until: float,
                  start_count: float, out: Any) -> None:
    import aiohttp

    admin = {"Authorization": f"Bearer {token}"}
    done = errors = 0

    async def one(http: aiohttp.ClientSession, k: int) -> None:
        nonlocal done, errors
        n = 0
        while time.time() < until:
            n += 1
            # half the sessions bring an id of their own (which any process may own); the others take
            # the one the process that opened them makes up (its own)
            body = {"session_id": f"c{os.getpid()}-{k}-{n}"} if k % 2 else {}
            try:
                async with http.post(f"{base}/admin/sessions", json=body, headers=admin) as r:
                    opened = await r.json()
                messages = [{"role": "user", "content": f"Count from {k} to {k + 9}."}]
                for turn in range(calls):
                    req = {"model": "tiny-tools", "messages": messages, "max_tokens": max_tokens,
                           "temperature": 1.0, "ignore_eos": True}
                    async with http.post(f"{opened['base_url']}/chat/completions", json=req) as r:
                        reply = await r.json()
                        ok = r.status == 200
                    if time.time() >= start_count:
                        done, errors = done + ok, errors + (not ok)
                    if not ok:
                        break
                    messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                                 {"role": "user", "content": f"And then {turn}?"}]
                sid = opened["session_id"]
                async with http.post(f"{base}/admin/sessions/{sid}/close", headers=admin) as r:
                    await r.read()
            except (TimeoutError, aiohttp.ClientError, KeyError, ValueError):
                if time.time() >= start_count:
                    errors += 1
                await asyncio.sleep(0.1)

    connector = aiohttp.TCPConnector(limit=sessions)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(one(http, k) for k in range(sessions)))
    out.put({"done": done, "errors": errors})


def client_main(*args: Any) -> None:
    die_with_parent()
    asyncio.run(_client(*args))


# -- one configuration -----------------------------------------------------------------------------
def one_config(processes: int, url: str, engine_pid: int, root: Path,
               args: argparse.Namespace) -> dict[str, Any]:
    run_dir, port = root / f"p{processes}", free_port()
    config = root / f"p{processes}.toml"
    serve_config(config, run_dir, port, url, processes)
    out = open(root / f"serve-p{processes}.out", "wb")  # noqa: SIM115 - closed below
    serve = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "serve", "--config", str(config)],
                             stdout=out, stderr=subprocess.STDOUT, preexec_fn=tied_to_this_process())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                token = (run_dir / "admin_token").read_text().strip()
                code, status = get_json(f"{base}/admin/status", token, timeout_s=10)
                if code == 200 and len(status.get("router_processes") or []) == processes - 1:
                    break
            except OSError:  # no token yet
                pass
            if serve.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve with {processes} router processes did not start; see {out.name}")
            time.sleep(1)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        now = time.time()
        start_count, until = now + args.warmup, now + args.warmup + args.duration
        work = (base, token, args.sessions, args.calls, args.max_tokens, until, start_count, queue)
        clients = [ctx.Process(target=client_main, args=work) for _ in range(args.clients)]
        for c in clients:
            c.start()
        time.sleep(max(0.0, start_count - time.time()))
        routers = [serve.pid, *descendants(serve.pid)]
        before = {"routers": sum(cpu_s(p) for p in routers), "engine": cpu_s(engine_pid),
                  "clients": sum(cpu_s(c.pid) for c in clients if c.pid), "t": time.monotonic()}
        counters0 = _counters(base, token)
        time.sleep(max(0.0, until - time.time()))
        after = {"routers": sum(cpu_s(p) for p in routers), "engine": cpu_s(engine_pid),
                 "clients": sum(cpu_s(c.pid) for c in clients if c.pid), "t": time.monotonic()}
        counters1 = _counters(base, token)
        results = [queue.get(timeout=180) for _ in clients]
        for c in clients:
            c.join(timeout=30)
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
        out.close()
    window = after["t"] - before["t"]
    done = sum(r["done"] for r in results)
    calls = {k: {name: v - counters0.get(k, {}).get(name, 0) for name, v in c.items()}
             for k, c in counters1.items()}
    forwarded = sum(c.get("forwarded", 0) for c in calls.values())
    router_calls = sum(c.get("calls", 0) for c in calls.values())
    return {
        "router_processes": processes,
        "completions": done,
        "completions_per_s": round(done / args.duration, 1),
        "errors": sum(r["errors"] for r in results),
        "window_s": round(window, 2),
        "cpu_ms_per_completion": {k: round(1000 * (after[k] - before[k]) / max(done, 1), 3)
                                  for k in ("routers", "engine", "clients")},
        "router_cores": round((after["routers"] - before["routers"]) / window, 3),
        "calls_per_process": {k: c.get("calls", 0) for k, c in calls.items()},
        "forwarded_share": round(forwarded / router_calls, 3) if router_calls else 0.0,
    }


def _counters(base: str, token: str) -> dict[str, dict[str, float]]:
    """Each router process's counters (serve's as "0"), from serve's status (the children's polled
    every 2 s: the window is long against it)."""
    code, status = get_json(f"{base}/admin/status", token, timeout_s=10)
    if code != 200:
        raise SystemExit(f"serve's status answered {code}")
    out = {"0": {k: v for k, v in (status.get("router") or {}).items() if isinstance(v, int | float)}}
    for child in status.get("router_processes") or []:
        out[str(child.get("process"))] = {k: v for k, v in (child.get("router") or {}).items()
                                          if isinstance(v, int | float)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--router-processes", default="1,2", help="the configurations, comma-separated")
    p.add_argument("--clients", type=int, default=2, help="load-generator processes")
    p.add_argument("--sessions", type=int, default=64, help="sessions each client holds open at once")
    p.add_argument("--calls", type=int, default=3, help="chained chat calls per session")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--run-root", default="", help="where the runs go (default: a temporary folder, removed)")
    args = p.parse_args()
    t0 = time.monotonic()
    from agentrl.models import resolve_model

    model = resolve_model("tiny-tools")
    root = Path(args.run_root or tempfile.mkdtemp(prefix="agentrl-router-processes-"))
    root.mkdir(parents=True, exist_ok=True)
    urls, engines = start_standins(1, model, "--tokens-per-s", "10000000", "--kv-tokens", "10000000",
                                   "--step-s", "0.002")
    try:
        configs = {}
        for n in [int(x) for x in args.router_processes.split(",")]:
            print(f"[router_processes] {n} process(es): {args.clients} clients x {args.sessions} sessions, "
                  f"{args.warmup:.0f} s warm-up, {args.duration:.0f} s counted", file=sys.stderr, flush=True)
            configs[str(n)] = one_config(n, urls[0], engines[0].pid, root, args)
            print(f"[router_processes] {json.dumps(configs[str(n)])}", file=sys.stderr, flush=True)
    finally:
        for e in engines:
            e.kill()
        if not args.run_root:
            shutil.rmtree(root, ignore_errors=True)
    first, last = configs[min(configs, key=int)], configs[max(configs, key=int)]
    print(json.dumps({
        "router_processes": [c["router_processes"] for c in configs.values()],
        "completions_per_s": {k: c["completions_per_s"] for k, c in configs.items()},
        "completions_per_s_one_process": first["completions_per_s"],
        "ratio": round(last["completions_per_s"] / max(first["completions_per_s"], 1e-9), 3),
        "cpu_ms_per_completion": {k: c["cpu_ms_per_completion"]["routers"] for k, c in configs.items()},
        "forwarded_share": {k: c["forwarded_share"] for k, c in configs.items()},
        "errors": sum(c["errors"] for c in configs.values()),
        "configs": configs,
        "wall_s": round(time.monotonic() - t0, 1),
    }))


if __name__ == "__main__":
    main()
