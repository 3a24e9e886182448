"""A weight publish through a network partition (#41 item 2), over real loopback TCP: serve's weight
receiver behind the partitioning proxy of ``tests/netproxy.py``, the recording engine stand-in of
``tests/test_weight_transfer.py`` behind it.

An upload cut in the middle of a chunk is sent again once the chunk's own timeout passes (not the
commit's ten minutes), and nothing half-received is loaded; a commit that serve carried out but
whose answer the partition swallowed returns once serve is seen serving the version (or, where serve
cannot be asked, ends as an ``unreachable`` error: the learner then compares versions), never as a
refusal that would stop the learner, and never after the commit's ten-minute limit.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agentrl.web import start_on_loopback
from agentrl.weights import WeightReceiver, WeightTransferError, publish
from tests.netproxy import Proxy
from tests.test_weight_sync import _serve as serve_receiver
from tests.test_weight_transfer import RecordingPool


class PartitionedOnLoad(RecordingPool):
    """Loads a version, then the network fails before serve's answer goes back, and heals a second
    later."""

    proxy: Proxy | None = None

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        result = await super().update_weights(path, version)
        proxy = self.proxy
        assert proxy is not None
        await asyncio.to_thread(proxy.set_mode, "blackhole")
        threading.Timer(1.0, proxy.set_mode, ("pass",)).start()
        return result


def test_a_publish_cut_mid_upload_is_sent_again_whole_and_loaded_once(tmp_path: Path) -> None:
    data = os.urandom(1 << 20)

    async def go() -> None:
        pool = RecordingPool()
        runner, url = await serve_receiver(pool, tmp_path / "w")  # type: ignore[arg-type]
        proxy = Proxy(int(url.rsplit(":", 1)[1]))
        try:
            proxy.cut_after(300_000)  # inside the second of four chunks' bodies
            result = await asyncio.wait_for(
                publish(data, 1, proxy.url, "", chunk_bytes=256 * 1024, parallel=1, chunk_timeout_s=2.0),
                timeout=60)
            assert proxy.cuts == 1
            assert result["version"] == 1 and pool.loaded == [(1, data)]  # whole, and once
            assert not list((tmp_path / "w").glob("*.staging"))
        finally:
            proxy.close()
            await runner.cleanup()

    asyncio.run(go())


def test_a_commit_whose_answer_the_partition_lost_is_unreachable_not_refused(tmp_path: Path) -> None:
    data = os.urandom(100_000)

    async def go() -> None:
        pool = PartitionedOnLoad()
        runner, url = await serve_receiver(pool, tmp_path / "w")  # type: ignore[arg-type]
        proxy = pool.proxy = Proxy(int(url.rsplit(":", 1)[1]))
        try:
            with pytest.raises(WeightTransferError) as e:
                await asyncio.wait_for(publish(data, 1, proxy.url, "", timeout_s=3.0),
                                       timeout=120)
            # serve holds version 1 (its answer was lost, then its version refused a resend): the
            # learner must treat this as "serve did not answer" and compare versions, not stop
            assert e.value.unreachable, e.value
            assert [v for v, _ in pool.loaded] == [1]
        finally:
            proxy.close()
            await runner.cleanup()

    asyncio.run(go())


def test_a_commit_whose_answer_was_lost_returns_once_serve_is_seen_serving_the_version(
        tmp_path: Path) -> None:
    data = os.urandom(100_000)

    async def go() -> None:
        pool = PartitionedOnLoad()
        app = web.Application(client_max_size=2**30)
        WeightReceiver(tmp_path / "w", pool).add_routes(app, lambda request: None)  # type: ignore[arg-type]

        async def info(request: web.Request) -> web.Response:
            return web.json_response({"version": pool.version})

        app.router.add_get("/admin/info", info)
        runner, url = await start_on_loopback(app)
        proxy = pool.proxy = Proxy(int(url.rsplit(":", 1)[1]))
        try:
            # the commit's own limit is ten minutes: serve, asked every 2 s, ends the wait
            result = await asyncio.wait_for(
                publish(data, 1, proxy.url, "", timeout_s=600.0, chunk_timeout_s=2.0), timeout=60)
            assert result["version"] == 1 and result["answer_lost"], result
            assert [v for v, _ in pool.loaded] == [1]
        finally:
            proxy.close()
            await runner.cleanup()

    asyncio.run(go())
