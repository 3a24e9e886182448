"""What the scoring stage's unit tests share: a task, a finished one-sample episode, and a stand-in
HTTP endpoint (a judge's or a teacher's)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from agentrl.buffer.sample import Sample
from agentrl.rollout.episode import EpisodeResult
from tests.conftest import free_port

TASK = {"id": "t1", "question": "What is 6 x 7?", "answer": "42"}


def finished_episode(group_id: str = "g", reward: float = 1.0) -> EpisodeResult:
    ep = EpisodeResult(episode_id=f"ep-{id(object())}", group_id=group_id, env="unit", task_id="t1",
                       reward=reward, answer="42", terminated=True)
    ep.samples = [Sample([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.1], [0, 0, 0], episode_id=ep.episode_id,
                         group_id=group_id, env="unit", reward=reward)]
    return ep


async def stand_in_endpoint(handler: Any, route: str = "/v1/chat/completions") -> tuple[web.AppRunner, str]:
    """``handler`` answering POST ``route`` on a free port; the runner and the base URL (``.../v1``)."""
    app = web.Application()
    app.router.add_post(route, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/v1"


