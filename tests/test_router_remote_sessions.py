"""A session closed over HTTP reaches a rollout worker on another machine as typed samples.

serve's router answers ``POST /admin/sessions/<id>/close`` with the buffer's binary batch
encoding; ``RemoteRouter.fetch_session`` decodes it into the same :class:`Sample` objects an
in-process session gives (numpy per-token fields), with the session's split count. Real HTTP on
loopback, records written by hand (no engine is called).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
from aiohttp import web

from agentrl.buffer.codec import decode_batch
from agentrl.buffer.sample import Sample
from agentrl.rollout.remote import RemoteRouter
from agentrl.router import EnginePool, Router, make_app
from agentrl.router.sessions import CallRecord, Completion
from tests.conftest import free_port


def _router() -> Router:
    router = Router(EnginePool(["http://127.0.0.1:9"]), model_name="m", eos_token_ids={2}, max_model_len=64,
                    render="engine")
    s = router.open_session("ep1", group_id="g1", env="calc")
    reply = {"role": "assistant", "content": "x"}
    s.record(
        CallRecord(
            "ep1",
            0,
            None,
            0,
            [1, 2, 3],
            [Completion([7, 8, 2], [-0.5, -0.25, -1.0], [3, 3, 3], "stop", reply)],
            engine="e0",
        )
    )
    s.record(
        CallRecord(
            "ep1",
            1,
            0,
            0,
            [1, 2, 3, 7, 8, 2, 5, 6],
            [
                Completion([9], [-2.0], [4], "length", reply),
                Completion([10, 11], [-0.1, -0.2], [4, 5], "stop", reply),
            ],
            engine="e0",
        )
    )
    s.splits = 1
    return router


def test_a_closed_session_comes_back_to_a_remote_worker_as_typed_samples() -> None:
    async def go() -> None:
        router = _router()
        want = router.sessions["ep1"].samples()
        runner = web.AppRunner(make_app(router, admin_token="tok"))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with RemoteRouter(f"http://127.0.0.1:{port}", "tok") as remote:
                fetched = await remote.end("ep1")
                assert await remote.end("never-opened") is None  # no model call: nothing to fetch
        finally:
            await runner.cleanup()
        assert "ep1" not in router.sessions  # closed on serve
        assert fetched is not None and fetched.splits == 1
        got = fetched.samples
        assert len(got) == len(want) == 2 and all(isinstance(s, Sample) for s in got)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
            assert g == replace(w, sample_id=g.sample_id)  # every field, arrays by value
        assert got[0].token_ids.tolist() == [1, 2, 3, 7, 8, 2, 5, 6, 9]
        assert got[0].loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1]
        assert got[1].versions.tolist() == [-1, -1, -1, 3, 3, 3, -1, -1, 4, 5]
        assert got[0].info == {"calls": [0, 1], "finish_reason": "length"}
        assert (got[0].episode_id, got[0].group_id, got[0].env) == ("ep1", "g1", "calc")

    asyncio.run(go())


def test_a_sessions_samples_route_answers_the_binary_batch_with_its_counts() -> None:
    async def go() -> None:
        router = _router()
        runner = web.AppRunner(make_app(router, admin_token="tok"))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            import aiohttp

            async with aiohttp.ClientSession(headers={"Authorization": "Bearer tok"}) as http:
                async with http.get(f"http://127.0.0.1:{port}/admin/sessions/ep1/samples") as r:
                    assert r.status == 200 and r.content_type == "application/octet-stream"
                    batch = decode_batch(await r.read())
                async with http.get(f"http://127.0.0.1:{port}/admin/sessions/ep1/samples",
                                    headers={"Authorization": "Bearer wrong"}) as r:
                    assert r.status == 401
        finally:
            await runner.cleanup()
        assert batch.info == {"session_id": "ep1", "splits": 1, "calls": 2} and len(batch.samples) == 2
        assert "ep1" in router.sessions  # reading the samples does not close the session

    asyncio.run(go())
