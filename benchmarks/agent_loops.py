"""How many concurrent agent loops one process runs without starving its event loop.

N episodes are kept in flight (closed loop: a finished episode's slot starts the next one) through
the real :class:`Router` and the real ``run_episode`` against a fast stand-in engine in its own
process: the product stand-in (:mod:`agentrl.engines.standin`) for the routes the router uses, with
the ``tiny-tools`` folder's tokenizer and chat template, so the router calibrates against it and
renders and derenders in this process as serve's router does (one generate round trip per model
call; ``--render engine`` measures the engine-rendering path instead), and a scripted generate
route: ``--tool-calls`` tool calls, then an answer, after ``--engine-ms`` of simulated decode time.
Each tool call sleeps a log-normal time (median ``--tool-median-ms``, shape ``--tool-sigma``: a
heavy tail; sigma 1.0 puts p99 near 10x the median).

Event-loop lag is sampled by a task that asks to wake every 10 ms and records how late it woke,
over the measurement window only (after the ramp-up). The agent process's collector is serve's
(``--gc pacer``, :mod:`agentrl.serve.collector`) unless ``--gc`` says otherwise; its event loop is
asyncio's or uvloop's (``--loop``). ``agent_cpu_ms_per_model_call`` is this process's CPU time
(user and system; the loops, the router and its HTTP client) over the window, per model call; the
stand-in engine's is ``engine_cpu_ms_per_model_call``. The last line printed is JSON.

    .venv/bin/python benchmarks/agent_loops.py --concurrency 20000 --duration 40 --ramp 20
    .venv/bin/python benchmarks/agent_loops.py --concurrency 50000 --duration 40 --ramp 30 --loop uvloop
    .venv/bin/python benchmarks/agent_loops.py --concurrency 200 --duration 10 --profile prof.out
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import logging
import math
import multiprocessing as mp
import os
import random
import resource
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
from aiohttp import web  # noqa: E402
from common import percentile  # benchmarks/common.py

import agentrl  # noqa: E402
from agentrl.engines.pool import dumps, loads  # noqa: E402
from agentrl.engines.standin import StandinEngine  # noqa: E402
from agentrl.models import eos_token_ids, resolve_model  # noqa: E402
from agentrl.rollout.episode import EpisodeLimits, run_episode  # noqa: E402
from agentrl.router import EnginePool, Router  # noqa: E402
from agentrl.serve import settle_gc  # noqa: E402
from agentrl.serve.collector import GcPacer  # noqa: E402

ENV_NAME = "bench_calc"
MODEL = "tiny-tools"  # a SmolLM2-shaped folder (its tokenizer and chat template) built locally in seconds


# --- the stand-in engine (its own process) -----------------------------------------------------------

class ScriptedEngine(StandinEngine):
    """The product stand-in (:mod:`agentrl.engines.standin`: the model folder's tokenizer and chat
    template behind vLLM's render and derender routes, so the router calibrates and renders locally
    as serve's does), with a generate route that plays a script instead of its throughput model:
    ``tool_calls`` python calls, then an answer, each after a log-normal decode time."""

    def __init__(self, model_dir: str, tool_calls: int, engine_ms: float, engine_sigma: float) -> None:
        super().__init__(model_dir, served_name=MODEL, max_model_len=1 << 15)
        self.engine_ms, self.engine_sigma = engine_ms, engine_sigma
        self.turn_end = self.tok.eos_ids[0]  # <|im_end|>: system + user, then assistant + tool per turn
        texts = [f'<tool_call>\n{{"name": "python", "arguments": {{"code": "print({t} + 1)"}}}}\n</tool_call>'
                 for t in range(tool_calls)] + [f"The answer is {tool_calls}."]
        self.replies = [[*self.tok.encode(t), self.turn_end] for t in texts]

    async def generate(self, request: web.Request) -> web.Response:
        req = loads(await request.read())
        turn = min(len(self.replies) - 1, (req["token_ids"].count(self.turn_end) - 2) // 2)
        ids = self.replies[turn]
        await asyncio.sleep(self.engine_ms / 1000 * math.exp(self.engine_sigma * random.gauss(0, 1)))
        entries = [{"token_id": t, "logprob": -0.5, "rank": 1,
                    "top_logprobs": [{"token_id": t, "logprob": -0.5, "rank": 1}]} for t in ids]
        return web.Response(body=dumps({"request_id": req.get("request_id"), "choices": [{
            "index": 0, "token_ids": ids, "finish_reason": "stop", "stop_reason": None,
            "logprobs": {"content": entries}, "routed_experts": None,
            "weight_versions": [{"version": "0", "start": 0, "end": len(ids)}]}]}),
            content_type="application/json")


def engine_main(port: int, model_dir: str, engine_ms: float, engine_sigma: float, tool_calls: int, ready: Any,
                gc_threshold: list[int] | None = None, pace_gc: bool = False) -> None:
    if gc_threshold:
        gc.set_threshold(*gc_threshold)
    engine = ScriptedEngine(model_dir, tool_calls, engine_ms, engine_sigma)

    async def serve() -> None:
        runner = web.AppRunner(engine.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=8192).start()
        if pace_gc:  # (a collector pass over its thousands of open requests would hold their answers
            GcPacer().start()  # and hand them to the agent process in one burst)
        ready.set()
        parent = os.getppid()
        while os.getppid() == parent:  # die with the benchmark, however it ends
            await asyncio.sleep(1.0)

    asyncio.run(serve())


# --- the environment: arithmetic with a slow, heavy-tailed tool --------------------------------------

class BenchCalc(agentrl.ToolEnv):
    system_prompt = "Use the python tool, then answer."
    max_turns = 16
    tool_median_s = 0.2
    tool_sigma = 1.0

    def tasks(self, split: str = "train"):
        return ({"id": str(i), "question": "What is 1 + 1?"} for i in range(10**9))

    @agentrl.tool
    async def python(self, code: str) -> str:
        """Run Python code (simulated: sleeps a log-normal time)."""
        await asyncio.sleep(min(30.0, self.tool_median_s * math.exp(self.tool_sigma * random.gauss(0, 1))))
        return "2"

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        return 1.0 if "answer" in answer else 0.0


agentrl.environment(ENV_NAME)(BenchCalc)


# --- the driver ----------------------------------------------------------------------------------------

async def lag_monitor(samples: list[float], own: list[float], measuring: asyncio.Event,
                      interval: float = 0.01) -> None:
    """Wall-clock lag of a 10 ms sleep, and the part of it this thread spent on the CPU.

    On a shared machine the wall lag includes time the OS ran other processes; the CPU part is
    the lag the event loop's own work caused (at most the wall lag)."""
    loop = asyncio.get_running_loop()
    while True:
        t, c = loop.time(), time.thread_time()
        await asyncio.sleep(interval)
        if measuring.is_set():
            lag = max(0.0, loop.time() - t - interval)
            samples.append(lag * 1000)
            own.append(min(lag, time.thread_time() - c) * 1000)


async def bench(args: argparse.Namespace, port: int, engine_pid: int) -> dict[str, Any]:
    proc, engine_proc = psutil.Process(), psutil.Process(engine_pid)
    pool = EnginePool([f"http://127.0.0.1:{port}"], request_timeout_s=120, health_interval_s=5,
                      max_connections=args.engine_connections)
    router = Router(pool, model_name=MODEL, eos_token_ids=eos_token_ids(args.model_dir),
                    max_model_len=1 << 15, model_dir=args.model_dir, render=args.render)
    await pool.start()
    await router.renderers.calibrate(pool.engines[0])  # as serve does at start (local render, or why not)
    limits = EpisodeLimits(max_turns=args.tool_calls + 2, max_tokens=256, max_episode_tokens=1 << 16,
                           episode_timeout_s=300)
    pacer = None
    if args.gc == "pacer":
        pacer = GcPacer(interval_s=args.gc_interval_ms / 1000, young=args.gc_young)
    if pacer is not None:
        pacer.start()  # as serve does once it is up (agentrl.serve.collector)
    elif args.gc == "thresholds":
        settle_gc()  # serve's earlier settings: start-up's objects frozen, higher thresholds
        gc.set_threshold(*args.gc_threshold)  # unless --gc-threshold says otherwise
    else:
        gc.set_threshold(*args.gc_threshold)
        gc.collect()
    rss0 = proc.memory_info().rss
    stop, measuring = asyncio.Event(), asyncio.Event()
    lags: list[float] = []
    own_lags: list[float] = []
    load0 = os.getloadavg()[0]
    done = {"episodes": 0, "measured": 0, "errors": 0, "truncated": 0, "turns": 0}
    errors: dict[str, int] = {}

    async def slot(i: int) -> None:
        await asyncio.sleep(args.ramp * i / args.concurrency)  # spread the start over the ramp
        k = 0
        while not stop.is_set():
            ep = await run_episode(router, ENV_NAME, {"id": f"{i}-{k}", "question": "What is 1 + 1?"},
                                   group_id=f"g{i}", limits=limits)
            k += 1
            done["episodes"] += 1
            done["turns"] += ep.turns
            if measuring.is_set():
                done["measured"] += 1
            if ep.error:
                done["errors"] += 1
                errors[ep.error[:80]] = errors.get(ep.error[:80], 0) + 1
                # An episode can fail without ever suspending (e.g. no engine in the pool): back off,
                # or this loop never yields and starves the health checker that would recover it.
                await asyncio.sleep(1.0)
            done["truncated"] += ep.truncated

    # each collection's wall time, and the CPU time this thread spent in it (on a shared machine the
    # wall time includes time the OS gave other processes)
    gc_pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    gc_cpu: dict[int, list[float]] = {0: [], 1: [], 2: []}
    gc_start = [0.0, 0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0], gc_start[1] = time.perf_counter(), time.thread_time()
        elif measuring.is_set():
            gc_pauses[info["generation"]].append((time.perf_counter() - gc_start[0]) * 1000)
            gc_cpu[info["generation"]].append((time.thread_time() - gc_start[1]) * 1000)

    gc.callbacks.append(on_gc)
    monitor = asyncio.create_task(lag_monitor(lags, own_lags, measuring))
    tasks = [asyncio.create_task(slot(i)) for i in range(args.concurrency)]
    await asyncio.sleep(args.ramp + args.warmup)
    profiler = cProfile.Profile() if args.profile else None
    cpu0, ecpu0, calls0, t0 = (
        proc.cpu_times(),
        engine_proc.cpu_times(),
        router.counters["calls"],
        time.monotonic(),
    )
    measuring.set()
    if profiler:
        profiler.enable()
    rss_peak = proc.memory_info().rss
    tracked = len(gc.get_objects())
    while time.monotonic() - t0 < args.duration:
        await asyncio.sleep(1.0)
        rss_peak = max(rss_peak, proc.memory_info().rss)
    measuring.clear()
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    wall, cpu1, ecpu1, calls1 = (
        time.monotonic() - t0,
        proc.cpu_times(),
        engine_proc.cpu_times(),
        router.counters["calls"],
    )
    stop.set()
    in_flight = sum(not t.done() for t in tasks)
    for t in tasks:  # cancelled episodes still close their router sessions (run_episode's finally)
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    leaked_sessions = len(router.sessions)
    monitor.cancel()
    gc.callbacks.remove(on_gc)
    pacer_stats = pacer.stats() if pacer is not None else {}
    if pacer is not None:
        pacer.stop()
    await pool.close()
    calls = max(1, calls1 - calls0)
    cpu_user, cpu_sys = cpu1.user - cpu0.user, cpu1.system - cpu0.system
    cpu = cpu_user + cpu_sys
    ecpu = (ecpu1.user - ecpu0.user) + (ecpu1.system - ecpu0.system)
    return {
        "concurrent_episodes": args.concurrency,
        "in_flight_at_end": in_flight,
        "episodes_per_s": round(done["measured"] / wall, 1),
        "model_calls_per_s": round((calls1 - calls0) / wall, 1),
        # this process only (the agent loops and the router), not the stand-in engine's
        "agent_cpu_ms_per_model_call": round(cpu * 1000 / calls, 3),
        "agent_user_cpu_ms_per_model_call": round(cpu_user * 1000 / calls, 3),
        "agent_sys_cpu_ms_per_model_call": round(cpu_sys * 1000 / calls, 3),
        "engine_cpu_ms_per_model_call": round(ecpu * 1000 / calls, 3),
        "loop_lag_p50_ms": round(percentile(lags, 0.5), 2),
        "loop_lag_p99_ms": round(percentile(lags, 0.99), 2),
        "loop_lag_max_ms": round(max(lags, default=float("nan")), 2),
        "loop_lag_own_cpu_p99_ms": round(percentile(own_lags, 0.99), 2),
        "machine_load_avg_1m": [round(load0, 1), round(os.getloadavg()[0], 1)],
        "cpus": os.cpu_count(),
        "rss_mb_per_1k_episodes": round((rss_peak - rss0) / 2**20 / args.concurrency * 1000, 1),
        "rss_mb": round(rss_peak / 2**20, 1),
        "gc_tracked_objects": tracked,
        "gc_thresholds": list(gc.get_threshold()),
        "gc_full_collections": len(gc_pauses[2]),
        "gc_full_pause_max_ms": round(max(gc_pauses[2], default=0), 1),
        "gc_pause_total_ms": round(sum(map(sum, gc_pauses.values())), 1),
        "gc_pause_max_ms_by_generation": [round(max(gc_pauses[g], default=0), 1) for g in range(3)],
        "gc_pause_cpu_max_ms_by_generation": [round(max(gc_cpu[g], default=0), 1) for g in range(3)],
        "gc_pause_cpu_total_ms": round(sum(map(sum, gc_cpu.values())), 1),
        "gc_collections_by_generation": [len(gc_pauses[g]) for g in range(3)],
        "gc": args.gc,
        "gc_young": args.gc_young,
        **{f"pacer_{k}": v for k, v in pacer_stats.items()},
        "agent_process_cpu_util": round(cpu / wall, 2),
        "engine_process_cpu_util": round(ecpu / wall, 2),
        "leaked_sessions": leaked_sessions,
        "episodes": done["episodes"],
        "errors": done["errors"],
        "error_kinds": errors,
        "truncated": done["truncated"],
        "router_splits": router.counters["splits"],
        "render": args.render,
        "local_render": router.renderers.state,  # "on": calibrated, rendering in this process
        "local_renders": router.counters["local_renders"],
        "engine_renders": router.counters["engine_renders"],
        "tool_median_ms": args.tool_median_s * 1000,
        "tool_sigma": args.tool_sigma,
        "tool_calls_per_episode": args.tool_calls,
        "engine_ms": args.engine_ms,
        "engine_sigma": args.engine_sigma,
        "loop": args.loop,
        "engine_connections_max": args.engine_connections,
        "open_files_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "duration_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=5000)
    p.add_argument("--duration", type=float, default=60.0, help="measurement window, seconds")
    p.add_argument("--ramp", type=float, default=30.0, help="seconds over which the episodes start")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds after the ramp before measuring")
    p.add_argument("--tool-calls", type=int, default=3, help="tool calls per episode (then an answer)")
    p.add_argument("--tool-median-ms", type=float, default=2000.0)
    p.add_argument("--tool-sigma", type=float, default=1.0)
    p.add_argument("--engine-ms", type=float, default=20000.0,
                   help="median simulated decode time per model call (a few hundred tokens at the 20-50 "
                        "tokens/s one sequence gets in a heavily batched engine)")
    p.add_argument("--engine-sigma", type=float, default=0.3, help="log-normal shape of the decode time")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="the agent process's event loop (uvloop when installed)")
    p.add_argument("--uvloop", dest="loop", action="store_const", const="uvloop", help="--loop uvloop")
    from agentrl.serve import GC_THRESHOLD

    p.add_argument(
        "--gc-threshold",
        type=int,
        nargs=3,
        default=list(GC_THRESHOLD),
        metavar=("G0", "G1", "G2"),
        help="gc.set_threshold for the agent process (default: what `agentrl serve` sets; "
        "pass 700 10 10 for Python's own)",
    )
    p.add_argument("--gc", choices=("pacer", "thresholds", "python"), default="pacer",
                   help="the agent process's collector: serve's pacer (agentrl.serve.collector; the "
                   "stand-in engine's process paced too), serve's earlier settle_gc() with --gc-threshold, "
                   "or Python's own collection with --gc-threshold")
    p.add_argument("--gc-interval-ms", type=float, default=50.0, help="the pacer's interval")
    p.add_argument("--gc-young", action=argparse.BooleanOptionalAction, default=False,
                   help="the pacer collects the young generation each tick (else it only freezes it)")
    p.add_argument("--engine-connections", type=int, default=None,
                   help="the router's connections to the engine at most (EnginePool.max_connections; calls "
                   "beyond wait); default: what this process's open-file limit leaves (HTTP/1.1 holds a "
                   "socket per call in flight, and the stand-in engine's process has the same limit)")
    p.add_argument("--render", choices=("auto", "engine"), default="auto",
                   help="the router's render (Router's render=): auto renders and derenders in this process "
                   "once calibrated, as serve's router does; engine asks the engine's routes (3 round trips)")
    p.add_argument("--profile", default="", help="write a cProfile of the measurement window here")
    args = p.parse_args()
    if args.engine_connections is None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            soft = hard
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # (the engine's process inherits it)
        if soft != resource.RLIM_INFINITY and args.concurrency + 2048 > soft:
            args.engine_connections = max(64, soft - 2048)
    args.model_dir = resolve_model(MODEL)
    args.tool_median_s = args.tool_median_ms / 1000
    BenchCalc.tool_median_s, BenchCalc.tool_sigma = args.tool_median_s, args.tool_sigma
    logging.basicConfig(level=logging.WARNING)
    if args.gc_threshold:
        gc.set_threshold(*args.gc_threshold)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below on `timeout`
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    engine = ctx.Process(
        target=engine_main,
        args=(port, args.model_dir, args.engine_ms, args.engine_sigma, args.tool_calls, ready,
              args.gc_threshold, args.gc == "pacer"),
        daemon=True,
    )
    engine.start()
    try:
        if not ready.wait(30):
            raise SystemExit("the stand-in engine did not start")
        if args.loop == "uvloop":
            import uvloop

            result = uvloop.run(bench(args, port, engine.pid))
        else:
            result = asyncio.run(bench(args, port, engine.pid))
    finally:
        engine.terminate()
        engine.join(10)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
