"""Admission control counts every episode whose samples are not in the buffer yet: those playing,
and those done playing whose put is still under way (a slow disk, a busy loop). Counting only the
first let serve start group after group while puts lagged (CI saw 20 groups drawn against a bound
of 8)."""

from __future__ import annotations

import asyncio

from agentrl.buffer import Buffer, BufferConfig
from agentrl.rollout.episode import EpisodeResult
from agentrl.rollout.orchestrator import Orchestrator
from tests.scoring_helpers import finished_episode


class SlowPuts(Buffer):
    """The real buffer, whose puts wait until the test lets them through."""

    def __init__(self, cfg: BufferConfig) -> None:
        super().__init__(cfg)
        self.gate = asyncio.Event()
        self.waiting = 0

    async def put(self, samples: list) -> int:
        self.waiting += 1
        await self.gate.wait()
        self.waiting -= 1
        return await super().put(samples)


def test_episodes_whose_samples_are_still_on_their_way_to_the_buffer_count_against_admission() -> None:
    async def main() -> tuple[int, int, int, int]:
        buf = SlowPuts(BufferConfig(batch_size=4, max_staleness=1))  # bound: 2 x 4 = 8 episodes
        played = 0

        async def producer(task: dict, group_id: str) -> EpisodeResult:
            nonlocal played
            played += 1
            return finished_episode(group_id)  # done at once: its put is what takes long

        orch = Orchestrator(producer, buf, env_name="guess_number", group_size=2, max_concurrency=64)
        run = asyncio.create_task(orch.run())
        try:
            async with asyncio.timeout(60):
                while buf.waiting < 8:  # the bound's worth of episodes have played and wait to be put
                    await asyncio.sleep(0.01)
                for _ in range(50):  # many more turns of the rollout's loop: none may start another group
                    await asyncio.sleep(0.01)
                held = (played, buf.waiting)
                buf.gate.set()  # the puts land; the buffer is then full and nobody consumes
                while buf.stats()["produced"] < 8:
                    await asyncio.sleep(0.01)
                for _ in range(50):
                    await asyncio.sleep(0.01)
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        return (*held, played, buf.stats()["produced"])

    played_held, waiting, played, produced = asyncio.run(main())
    assert played_held == 8 and waiting == 8
    assert played == 8 and produced == 8
