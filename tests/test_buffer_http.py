"""The learner's HTTP view of the buffer on loopback: binary batches, long-poll, acks, auth, backpressure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from agentrl.buffer import Buffer, BufferClient, BufferConfig, Sample, add_buffer_routes
from agentrl.web import start_on_loopback

TOKEN = "s3cret"


def sample(version: int = 1, n: int = 64) -> Sample:
    return Sample(
        token_ids=list(range(n)),
        loss_mask=[0] * 8 + [1] * (n - 8),
        logprobs=[0.0] * 8 + [-0.5] * (n - 8),
        versions=[-1] * 8 + [version] * (n - 8),
        episode_id="e",
        group_id="g",
        env="t",
        reward=1.0,
    )


@asynccontextmanager
async def served(cfg: BufferConfig) -> AsyncIterator[tuple[Buffer, str]]:
    buf = Buffer(cfg)
    app = web.Application()
    add_buffer_routes(app, buf, TOKEN)
    runner, url = await start_on_loopback(app)
    try:
        yield buf, url
    finally:
        await runner.cleanup()
        buf.close()


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(fn())


def test_a_learner_fetches_a_binary_batch_and_acknowledges_it() -> None:
    async def go() -> None:
        async with served(BufferConfig(batch_size=3)) as (buf, url):
            put = [sample() for _ in range(3)]
            await buf.put(put)
            client = BufferClient(url, TOKEN, timeout_s=5)
            batch = await client.get_batch(learner_version=1, max_staleness=2, batch_size=3, timeout_s=1)
            assert batch is not None and batch.samples == put
            assert await client.ack(batch.batch_id)
            stats = await client.stats()
            assert stats["consumed"] == 3 and stats["identity_holds"]
            assert not await client.ack("no-such-batch")
            await client.close()

    run(go)


def test_the_batch_route_answers_204_when_nothing_is_ready_and_long_polls_otherwise() -> None:
    async def go() -> None:
        async with served(BufferConfig(batch_size=2)) as (buf, url):
            client = BufferClient(url, TOKEN, timeout_s=5)
            assert await client.get_batch(1, timeout_s=0.1) is None
            poll = asyncio.create_task(client.get_batch(1, timeout_s=5))
            await asyncio.sleep(0.2)
            await buf.put([sample(), sample()])
            batch = await asyncio.wait_for(poll, 3)
            assert batch is not None and len(batch) == 2
            await client.close()

    run(go)


def test_requests_without_the_admin_token_get_401() -> None:
    async def go() -> None:
        async with served(BufferConfig()) as (_, url), aiohttp.ClientSession() as http:
            for method, path in [("GET", "/buffer/batch?learner_version=1"), ("POST", "/buffer/ack"),
                                 ("GET", "/buffer/stats"), ("POST", "/buffer/release")]:
                async with http.request(method, url + path, headers={"Authorization": "Bearer wrong"}) as r:
                    assert r.status == 401

    run(go)


def test_bad_query_parameters_get_400_and_are_not_retried() -> None:
    async def go() -> None:
        async with served(BufferConfig()) as (_, url), aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with http.get(url + "/buffer/batch?learner_version=x", headers=headers) as r:
                assert r.status == 400

    run(go)


def test_too_many_concurrent_polls_get_429_with_retry_after() -> None:
    async def go() -> None:
        async with served(BufferConfig(max_pollers=1)) as (_, url), aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            first = asyncio.create_task(
                http.get(url + "/buffer/batch?learner_version=1&timeout_s=1", headers=headers)
            )
            await asyncio.sleep(0.2)
            async with http.get(url + "/buffer/batch?learner_version=1", headers=headers) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
            resp = await first
            assert resp.status == 204
            resp.release()

    run(go)


def test_a_released_lease_is_served_again_and_its_old_ack_is_refused() -> None:
    async def go() -> None:
        async with served(BufferConfig(batch_size=1)) as (buf, url):
            await buf.put([sample()])
            client = BufferClient(url, TOKEN, timeout_s=5)
            first = await client.get_batch(1)
            assert first is not None
            assert await client.release_leases() == 1
            again = await client.get_batch(1)
            assert again is not None and again.samples[0].sample_id == first.samples[0].sample_id
            assert not await client.ack(first.batch_id)
            assert await client.ack(again.batch_id)
            await client.close()

    run(go)
