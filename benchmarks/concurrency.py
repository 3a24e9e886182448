"""The concurrency controller against static caps (issue #38, item 1), on stand-in engines.

Stand-in engine processes (``agentrl.engines.standin``: a throughput model with a KV cache that
preempts when it overflows, and a prefill cost paid again by every preempted request) serve
synthetic token-level episodes. The episodes are started by the real
:class:`~agentrl.rollout.orchestrator.Orchestrator` (admission never binds here: the sink always has
room), their model calls go through the real :class:`~agentrl.engines.pool.EnginePool`
(least-outstanding balancing, the pool's upstream client), and between turns an episode waits a
drawn "tool" latency, so too few episodes in flight leave the engines idle and too many overflow
their KV caches. The router's render / derender path is left out (token ids go straight to
generate): on two cores it would measure the router, not the limit.

Workloads: ``short`` (one turn, short prompt and answer), ``long`` (several turns, a growing
context), ``mixed`` (heavy-tailed: turns and answer lengths drawn from long-tailed laws). Each runs
once with the controller (``env.concurrency`` defaults, ``env.max_concurrency`` = the largest cap
as its bound) and once per static cap, in groups of ``--group-size`` (serve's default, 4); each
run plays for ``--warmup`` seconds, then counts the episodes finished in ``--duration`` seconds,
and the engines' preemptions in that window. Every run draws the same episodes (``--seed``). One
episode makes one sample here, so samples/s is episodes/s.

    python benchmarks/concurrency.py [--workloads short,long,mixed] [--caps 4,8,16,32,64,128]
        [--duration 20] [--warmup 5] [--engines 2] [--controller '{"decrease": 0.85}']

Final JSON line: ``workloads`` (per workload ``controller_samples_per_s``,
``best_static_samples_per_s``, ``best_static_cap``, ``ratio``, ``preemptions_controller``,
``preemptions_best_static``, and every run's figures) and ``min_ratio``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import start_standins  # noqa: E402

from agentrl.engines.pool import EnginePool, metric_sums  # noqa: E402
from agentrl.rollout.concurrency import ConcurrencyController, http_reader  # noqa: E402
from agentrl.rollout.config import ConcurrencyConfig  # noqa: E402
from agentrl.rollout.episode import EpisodeResult  # noqa: E402
from agentrl.rollout.orchestrator import Orchestrator  # noqa: E402

log = logging.getLogger("concurrency")


@dataclass(frozen=True)
class Workload:
    prompt: int  # first prompt's tokens
    turns: tuple[int, int]  # drawn uniformly in [lo, hi], or heavy-tailed when ``tail``
    answer: int  # tokens per answer (the mean, when ``tail``)
    observation: int  # tokens a tool result adds to the context per turn
    tool_s: tuple[float, float]  # tool latency per turn, uniform in [lo, hi]
    tail: bool = False


WORKLOADS = {
    "short": Workload(prompt=150, turns=(1, 1), answer=60, observation=0, tool_s=(0.05, 0.15)),
    "long": Workload(prompt=400, turns=(4, 6), answer=120, observation=80, tool_s=(0.1, 0.4)),
    "mixed": Workload(prompt=200, turns=(1, 8), answer=100, observation=60, tool_s=(0.02, 0.6), tail=True),
}


def plan(w: Workload, rng: random.Random) -> list[tuple[int, float]]:
    """An episode's turns: (answer tokens, tool latency after it)."""
    if w.tail:  # Pareto turns, lognormal answers: most are short, a few are very long
        turns = min(w.turns[1], max(w.turns[0], int(rng.paretovariate(1.5))))
        answers = [min(1000, max(8, int(rng.lognormvariate(0, 1.0) * w.answer * 0.6))) for _ in range(turns)]
    else:
        turns = rng.randint(*w.turns)
        answers = [w.answer] * turns
    return [(a, rng.uniform(*w.tool_s)) for a in answers]


def producer(pool: EnginePool, w: Workload, seed: int) -> Any:
    rng = random.Random(seed)

    async def play(task: dict[str, Any], group_id: str) -> EpisodeResult:
        ep = EpisodeResult(episode_id=f"{group_id}-{rng.random():.9f}", group_id=group_id, env="bench",
                           task_id=str(task.get("id", "")))
        context = w.prompt
        for answer, tool_s in plan(w, rng):
            if context + answer >= 2000:  # the stand-in's context length (2,048): the episode ends
                break
            engine = pool.pick(group_id + ep.episode_id)  # a session sticks to its engine
            body = {"token_ids": [300 + (context + i) % 50 for i in range(context)], "model": "tiny-tools",
                    "sampling_params": {"max_tokens": answer, "ignore_eos": True}}
            out = await pool.call(engine, "/inference/v1/generate", body)
            made = len(out["choices"][0]["token_ids"])
            ep.completion_tokens += made
            ep.turns += 1
            context += made + w.observation
            await asyncio.sleep(tool_s)
        pool.forget_session(group_id + ep.episode_id)
        ep.terminated = True
        return ep

    return play


class Sink:
    """Always room: the limit under test is the only bound."""

    async def wait_for_room(self, in_flight: int, timeout_s: float) -> int:
        return 1 << 30

    async def put(self, samples: list[Any]) -> int:
        return len(samples)


async def preemptions(pool: EnginePool) -> float:
    import aiohttp

    total = 0.0
    async with aiohttp.ClientSession() as http:
        for e in pool.engines:
            async with http.get(e.url + "/metrics") as r:
                total += metric_sums(await r.text(), ["vllm:num_preemptions_total"]).get(
                    "vllm:num_preemptions_total", 0.0)
    return total


async def one_run(urls: list[str], w: Workload, *, cap: int | None, max_cap: int, warmup: float,
                  duration: float, seed: int, group_size: int,
                  settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Episodes/s and preemptions of one configuration (``cap`` None: the controller)."""
    pool = EnginePool(urls, health_interval_s=3600)
    await pool.start()
    finished: list[float] = []
    orch = Orchestrator(producer(pool, w, seed), Sink(), env_name="arithmetic", group_size=group_size,
                        max_concurrency=cap or max_cap,
                        episode_log=lambda line: finished.append(time.monotonic()))
    controller = None
    if cap is None:
        read, close = http_reader(pool.engines)
        controller = ConcurrencyController(ConcurrencyConfig(controller=True, **(settings or {})),
                                           static_cap=max_cap,
                                           group_size=group_size, read=read, close=close,
                                           in_flight=lambda: orch.in_flight)
        orch.concurrency = controller
        controller.start()
    run = asyncio.create_task(orch.run())
    limits: list[int] = []
    try:
        await asyncio.sleep(warmup)
        p0, n0, t0 = await preemptions(pool), len(finished), time.monotonic()
        while time.monotonic() - t0 < duration:
            await asyncio.sleep(0.5)
            limits.append(controller.limit if controller else cap)
        p1, n1, t1 = await preemptions(pool), len(finished), time.monotonic()
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        if controller is not None:
            status = controller.status()
            await controller.stop()
        await pool.close()
    out = {"cap": cap if cap else "controller", "samples_per_s": round((n1 - n0) / (t1 - t0), 3),
           "episodes": n1 - n0, "preemptions": int(p1 - p0),
           "mean_limit": round(sum(limits) / max(1, len(limits)), 1)}
    if controller is not None:
        out["decisions"] = status["decisions"]
        out["back_off_reasons"] = status["back_off_reasons"]
    return out


def start_engines(n: int, model: str, args: argparse.Namespace) -> tuple[list[str], list[subprocess.Popen]]:
    return start_standins(n, model, "--tokens-per-s", str(args.tokens_per_s), "--kv-tokens",
                          str(args.kv_tokens), "--prefill-s-per-token", str(args.prefill_s_per_token),
                          "--step-s", "0.02")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="short,long,mixed")
    p.add_argument("--caps", default="4,8,16,32,64,128", help="the static caps swept (episodes in flight)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds counted per run")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds played before counting")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--tokens-per-s", type=float, default=4000.0)
    p.add_argument("--kv-tokens", type=int, default=12000)
    p.add_argument("--prefill-s-per-token", type=float, default=2e-5)
    p.add_argument("--model", default="tiny-tools")
    p.add_argument("--group-size", type=int, default=4, help="episodes per group (serve's env.group_size)")
    p.add_argument("--seed", type=int, default=0, help="the episodes' draws (the same for every run)")
    p.add_argument("--controller", default="{}",
                   help="env.concurrency settings as JSON (default: its defaults)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    from agentrl.models import resolve_model

    caps = [int(c) for c in args.caps.split(",")]
    urls, procs = start_engines(args.engines, resolve_model(args.model), args)
    results: dict[str, Any] = {}
    try:
        for name in args.workloads.split(","):
            w = WORKLOADS[name]
            runs = []
            for cap in [None, *caps]:
                r = asyncio.run(one_run(urls, w, cap=cap, max_cap=max(caps), warmup=args.warmup,
                                        duration=args.duration, seed=args.seed, group_size=args.group_size,
                                        settings=json.loads(args.controller)))
                time.sleep(1.0)  # the stand-ins drop what the cancelled run left (its clients left)
                print(json.dumps({"workload": name, **r}), flush=True)
                runs.append(r)
            ctrl, static = runs[0], runs[1:]
            best = max(static, key=lambda r: r["samples_per_s"])
            results[name] = {
                "controller_samples_per_s": ctrl["samples_per_s"],
                "best_static_samples_per_s": best["samples_per_s"], "best_static_cap": best["cap"],
                "ratio": (round(ctrl["samples_per_s"] / best["samples_per_s"], 3)
                          if best["samples_per_s"] else None),
                "preemptions_controller": ctrl["preemptions"], "preemptions_best_static": best["preemptions"],
                "runs": runs}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    ratios = [r["ratio"] for r in results.values() if r["ratio"] is not None]
    print(json.dumps({"benchmark": "concurrency", "engines": args.engines, "tokens_per_s": args.tokens_per_s,
                      "kv_tokens": args.kv_tokens, "prefill_s_per_token": args.prefill_s_per_token,
                      "duration_s": args.duration, "warmup_s": args.warmup, "caps": caps,
                      "group_size": args.group_size,
                      "controller": json.loads(args.controller),
                      "workloads": results, "min_ratio": min(ratios) if ratios else None}))


if __name__ == "__main__":
    main()
