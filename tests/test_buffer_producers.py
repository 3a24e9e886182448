"""Remote producers (Ray rollout workers) put samples into serve's buffer over HTTP, once each,
and share one admission bound."""

from __future__ import annotations

import asyncio

import aiohttp

from agentrl.buffer import BufferClient, BufferConfig
from agentrl.rollout.remote import RemoteBuffer
from tests.test_buffer_http import TOKEN, sample, served


def test_a_remote_producer_puts_samples_and_a_retried_put_stores_nothing_twice() -> None:
    async def go() -> None:
        async with served(BufferConfig(batch_size=2, group_size=2)) as (buf, url):
            client = BufferClient(url, TOKEN, timeout_s=5)
            samples = [sample(), sample()]
            samples[1].episode_id = "e2"
            assert await client.put(samples) == 2
            assert await client.put(samples) == 0  # the same sample ids again: a retry after a lost answer
            assert buf.stats()["produced"] == 2
            batch = await client.get_batch(learner_version=1, max_staleness=2, batch_size=2, timeout_s=1)
            assert batch is not None and sorted(s.sample_id for s in batch.samples) == sorted(
                s.sample_id for s in samples)
            await client.close()

    asyncio.run(go())


def test_remote_producers_share_one_admission_bound() -> None:
    async def go() -> None:
        # bound: (max_staleness + 1) x batch_size = 2 x 4 = 8 episodes in flight or buffered
        async with served(BufferConfig(batch_size=4, max_staleness=1)) as (_, url):
            a, b = BufferClient(url, TOKEN, timeout_s=5), BufferClient(url, TOKEN, timeout_s=5)
            assert await a.wait_for_room("worker-a", 6, 0) == 2
            assert await b.wait_for_room("worker-b", 0, 0) == 2  # worker-a's 6 count here too
            assert await b.wait_for_room("worker-b", 2, 0) == 0
            remote = RemoteBuffer(url, TOKEN, producer="worker-c")
            assert await remote.wait_for_room(0, 0) == 0  # 6 + 2 already
            await asyncio.gather(a.close(), b.close(), remote.close())

    asyncio.run(go())


def test_the_producer_routes_need_the_admin_token() -> None:
    async def go() -> None:
        async with served(BufferConfig()) as (_, url), aiohttp.ClientSession() as http:
            for path in ("/buffer/samples", "/buffer/room"):
                async with http.post(url + path, data=b"x") as r:
                    assert r.status == 401

    asyncio.run(go())
