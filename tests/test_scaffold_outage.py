"""A scaffold episode hit by an engine outage is a model failure, not the scaffold's, and the
orchestrator backs off on it exactly as it does for the built-in loop.

Real router over HTTP (aiohttp on a loopback port) in front of an engine address nobody listens
on; the scaffold is an ordinary OpenAI-client program that fails when its call fails.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from aiohttp import web
from openai import AsyncOpenAI

from agentrl.rollout.config import EpisodeLimits
from agentrl.rollout.orchestrator import Orchestrator
from agentrl.rollout.scaffold import ScaffoldContext, ScaffoldLoop
from agentrl.router import EnginePool, Router, make_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def openai_agent(ctx: ScaffoldContext) -> str | None:
    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=30)
    reply = await client.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=8)
    return reply.choices[0].message.content


async def buggy_agent(ctx: ScaffoldContext) -> str | None:
    raise RuntimeError("scaffold bug")


class Sink:
    def __init__(self) -> None:
        self.samples: list[Any] = []

    async def wait_for_room(self, in_flight: int, timeout_s: float) -> int:
        return 100

    async def put(self, samples: list[Any]) -> int:
        self.samples += samples
        return len(samples)


async def _play(agent: Any, episodes: int) -> tuple[Orchestrator, Sink]:
    dead = f"http://127.0.0.1:{_free_port()}"  # refused: the engine is down
    pool = EnginePool([dead], request_timeout_s=10, health_interval_s=3600)
    await pool.start()
    router = Router(pool, model_name="m", eos_token_ids={2}, max_model_len=2048, render="engine", retries=0)
    runner = web.AppRunner(make_app(router))
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    sink = Sink()
    try:
        loop = ScaffoldLoop(router, "guess_number", {}, EpisodeLimits(max_turns=2), scaffold=agent,
                            base_url=f"http://127.0.0.1:{port}")
        orch = Orchestrator(
            loop,
            sink,
            env_name="guess_number",
            group_size=episodes,
            max_concurrency=episodes,
            max_episodes=episodes,
        )
        await asyncio.wait_for(orch.run(), 120)
    finally:
        await runner.cleanup()
        await pool.close()
    return orch, sink


def test_a_scaffold_hit_by_an_engine_outage_is_a_model_failure_and_the_loops_back_off() -> None:
    orch, sink = asyncio.run(_play(openai_agent, 2))
    assert orch.counters["failed"] == 2 and orch.failed_by_kind == {"model": 2}
    assert orch.backing_off  # the next group would wait, as for the built-in loop's model failures
    assert all(s.error_kind == "model" and s.error.startswith("ModelError") for s in sink.samples)


def test_a_scaffold_that_fails_on_its_own_is_still_the_scaffolds_failure() -> None:
    orch, sink = asyncio.run(_play(buggy_agent, 2))
    assert orch.failed_by_kind == {"scaffold": 2} and not orch.backing_off
    assert all(s.error.startswith("ScaffoldError") and "scaffold bug" in s.error for s in sink.samples)
