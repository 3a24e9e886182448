"""A slow judge does not slow training: the same ``agentrl run`` with and without a 2 s LLM judge.

Both runs are the async pipeline of ``benchmarks/async_vs_sync.py`` (real vLLM engine, router,
buffer, learner, weight sync; the ``straggler`` environment's heavy-tailed episodes). The judged run
adds ``serve.scoring.judge``: every finished episode is graded by a judge endpoint that takes
``--judge-s`` seconds per call (a stand-in chat-completions server in this process, answering one
grade after the delay), weighed with the environment's reward. The scoring stage runs off the agent
loops' concurrency, so once the pipeline is full the learner should train as many samples per
second as without the judge: the issue's bar is within 10%.

Figures come from each run's ``learner.jsonl`` after ``--warmup`` steps (the pipeline full). Prints
one JSON line: ``samples_per_s_plain``, ``samples_per_s_judged``, ``pace_ratio`` (judged / plain),
``learner_idle_*``, ``judge_calls`` and ``judge_s``.

    python benchmarks/scoring_pace.py [--judge-s 2] [--steps 10] [--warmup 3] [--out runs/scoring_pace]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

from async_vs_sync import figures, run_mode, workload_options  # benchmarks/async_vs_sync.py
from common import free_port  # benchmarks/common.py


def start_judge(port: int, delay_s: float, calls: list[int]) -> None:
    """A chat-completions endpoint that answers the grade 7 after ``delay_s``, in a thread of its own."""
    from aiohttp import web

    async def grade(request: web.Request) -> web.Response:
        await request.read()
        calls[0] += 1
        await asyncio.sleep(delay_s)
        return web.json_response({"choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "7"}}]})

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", grade)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True, name="judge").start()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_options(p)
    p.add_argument("--judge-s", type=float, default=2.0, help="seconds the judge takes per call")
    p.add_argument("--scoring-concurrency", type=int, default=256, help="episodes judged at once")
    p.add_argument("--out", default="runs/scoring_pace")
    p.set_defaults(warmup=3)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port, calls = free_port(), [0]
    start_judge(port, args.judge_s, calls)
    judged = (f"--serve.scoring.judge.url=http://127.0.0.1:{port}/v1", "--serve.scoring.judge.model=judge",
              "--serve.scoring.env_weight=0.5", "--serve.scoring.judge.weight=0.5",
              f"--serve.scoring.concurrency={args.scoring_concurrency}",
              f"--serve.scoring.timeout_s={max(30.0, 10 * args.judge_s)}")
    runs = {"plain": run_mode("async", args, out, name="plain"),
            "judged": run_mode("async", args, out, name="judged", extra=judged)}
    fig = {name: figures(d, args.warmup) for name, d in runs.items()}
    result: dict[str, Any] = {"benchmark": "scoring_pace", "model": args.model, "batch": args.batch,
                              "group": args.group, "steps": args.steps, "warmup": args.warmup,
                              "judge_s": args.judge_s, "judge_calls": calls[0]}
    for name in runs:
        result[f"samples_per_s_{name}"] = round(fig[name]["samples_per_s"], 3)
        result[f"learner_idle_{name}"] = round(fig[name]["learner_idle"], 4)
        result[f"step_s_{name}"] = round(fig[name]["step_s_mean"], 2)
    result["pace_ratio"] = round(fig["judged"]["samples_per_s"] / fig["plain"]["samples_per_s"], 3)
    result["within_10pct"] = result["pace_ratio"] >= 0.9
    result["load_avg"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
