"""The HTTP/file transfer over real loopback HTTP: chunks verified and placed by offset, commits
checked against the chunks' digests, and nothing loaded that did not arrive whole.

A recording stand-in takes the engine updater's place (the choreography behind it is in
tests/test_weight_sync.py and, on real vLLM, tests/test_weight_sync_vllm.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agentrl.weights import WeightTransferError, publish
from tests.test_weight_sync import _serve as serve_receiver


class RecordingPool:
    def __init__(self) -> None:
        self.version = 0
        self.weights_path: str | None = None
        self.loaded: list[tuple[int, bytes]] = []

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        self.loaded.append((version, (Path(path) / "model.safetensors").read_bytes()))
        self.version, self.weights_path = version, path
        return {"version": version, "engines": {}, "failed": []}


async def _serve(root: Path) -> tuple[web.AppRunner, str, RecordingPool]:
    pool = RecordingPool()
    runner, url = await serve_receiver(pool, root)  # type: ignore[arg-type]
    return runner, url, pool


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _digest_of(shas: list[str]) -> str:
    return hashlib.sha256("".join(shas).encode()).hexdigest()


async def _put(http: aiohttp.ClientSession, url: str, version: int, index: int, offset: int, data: bytes,
               sha: str | None = None) -> int:
    async with http.put(f"{url}/admin/weights/{version}/chunks/{index}", data=data,
                        headers={"X-Sha256": sha or _sha(data), "X-Offset": str(offset)}) as r:
        return r.status


async def _commit(
    http: aiohttp.ClientSession, url: str, version: int, body: dict[str, Any]
) -> tuple[int, str]:
    async with http.post(f"{url}/admin/weights/{version}/commit", json=body) as r:
        return r.status, await r.text()


def test_a_pinned_versions_folder_stays_on_disk_and_a_restart_restores_it_before_the_latest(
    tmp_path: Path,
) -> None:
    from agentrl.web import start_on_loopback
    from agentrl.weights import WeightReceiver

    async def go() -> None:
        pool = RecordingPool()
        receiver = WeightReceiver(tmp_path / "w", pool, keep=2, pinned=[1])  # type: ignore[arg-type]
        app = web.Application(client_max_size=2**30)
        receiver.add_routes(app, lambda request: None)
        runner, url = await start_on_loopback(app)
        try:
            for v in (1, 2, 3, 4):
                await publish(f"weights {v}".encode(), v, url, "")
        finally:
            await runner.cleanup()
        # version 2 left the window of 2 (3, 4); the pinned 1 stays, marked loaded
        assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v1", "v3", "v4"]
        # a restarted serve: the pinned version first, then the latest (the policy's version)
        again = RecordingPool()
        restarted = WeightReceiver(tmp_path / "w", again, keep=2, pinned=[1, 7])  # type: ignore[arg-type]
        latest = restarted.latest_loaded()
        assert latest == (4, tmp_path / "w" / "v4")
        assert restarted.pinned_loaded(below=latest[0]) == [(1, tmp_path / "w" / "v1")]
        for version, path in [*restarted.pinned_loaded(below=latest[0]), latest]:
            await restarted.restore(version, path)
        assert [v for v, _ in again.loaded] == [1, 4] and again.version == 4

    asyncio.run(go())


@pytest.mark.parametrize("size", [0, 1, 64 * 1024, 1_000_003])
def test_published_weights_arrive_byte_for_byte_with_chunks_in_flight_at_once(
    tmp_path: Path, size: int
) -> None:
    data = os.urandom(size)

    async def go() -> None:
        runner, url, pool = await _serve(tmp_path / "w")
        try:
            result = await publish(data, 1, url, "", chunk_bytes=64 * 1024, parallel=4)
            assert result["version"] == 1 and pool.loaded == [(1, data)]
            assert (tmp_path / "w" / "v1" / "model.safetensors").read_bytes() == data
            assert not list((tmp_path / "w").glob("*.staging"))
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_chunks_in_any_order_and_resent_ones_make_the_same_file(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    parts = [(i, o, data[o : o + 3000]) for i, o in enumerate(range(0, len(data), 3000))]

    async def go() -> None:
        runner, url, pool = await _serve(tmp_path / "w")
        try:
            async with aiohttp.ClientSession() as http:
                for i, o, c in [*reversed(parts), parts[1], parts[0]]:  # backwards, then two again
                    assert await _put(http, url, 1, i, o, c) == 200
                body = {"chunks_sha256": _digest_of([_sha(c) for _, _, c in parts]), "chunks": len(parts),
                        "bytes": len(data)}
                assert (await _commit(http, url, 1, body))[0] == 200
            assert pool.loaded == [(1, data)]
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_a_corrupt_chunk_is_refused_and_the_commit_waits_for_it(tmp_path: Path) -> None:
    data = os.urandom(8000)
    a, b = data[:4000], data[4000:]

    async def go() -> None:
        runner, url, pool = await _serve(tmp_path / "w")
        try:
            async with aiohttp.ClientSession() as http:
                assert await _put(http, url, 1, 0, 0, a) == 200
                # damaged in transit
                assert await _put(http, url, 1, 1, 4000, b"x" * 4000, sha=_sha(b)) == 400
                body = {"chunks_sha256": _digest_of([_sha(a), _sha(b)]), "chunks": 2, "bytes": 8000}
                status, text = await _commit(http, url, 1, body)
                assert status == 409 and "missing [1]" in text and pool.loaded == []
                assert await _put(http, url, 1, 1, 4000, b) == 200  # sent again, whole this time
                assert (await _commit(http, url, 1, body))[0] == 200
            assert pool.loaded == [(1, data)]
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_a_commit_whose_digests_disagree_loads_nothing_and_the_next_attempt_starts_clean(
    tmp_path: Path,
) -> None:
    data = os.urandom(6000)

    async def go() -> None:
        runner, url, pool = await _serve(tmp_path / "w")
        try:
            async with aiohttp.ClientSession() as http:
                assert await _put(http, url, 1, 0, 0, data[:3000]) == 200
                assert await _put(http, url, 1, 1, 3000, data[3000:]) == 200
                wrong = {"chunks_sha256": _digest_of([_sha(data[3000:]), _sha(data[:3000])]),  # swapped order
                         "chunks": 2, "bytes": 6000}
                status, text = await _commit(http, url, 1, wrong)
                assert status == 400 and "digests" in text
                assert pool.loaded == [] and not (tmp_path / "w" / "v1").exists()
                assert not (tmp_path / "w" / "v1.staging").exists()
                assert (await _commit(http, url, 1, {"chunks": 2}))[0] == 400  # malformed: says what it needs
                assert await _put(http, url, 1, 0, 0, data[:3000]) == 200
                assert await _put(http, url, 1, 1, 3000, data[3000:]) == 200
                right = {"chunks_sha256": _digest_of([_sha(data[:3000]), _sha(data[3000:])]), "chunks": 2}
                # not what the chunks make
                status, text = await _commit(http, url, 1, dict(right, bytes=7000))
                assert status == 400 and "6000" not in text and "7000 bytes" in text and pool.loaded == []
                # an attempt that sent a longer payload and never committed...
                assert await _put(http, url, 1, 5, 5000, data[5000:]) == 200
            # ...then the learner publishes a shorter one for the same version: the old tail is cut
            short = data[:2500]
            assert (await publish(short, 1, url, "", chunk_bytes=1000))["version"] == 1
            assert pool.loaded == [(1, short)]
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_a_chunk_without_an_offset_is_a_clear_400_and_publish_does_not_retry_it(tmp_path: Path) -> None:
    async def go() -> None:
        runner, url, _ = await _serve(tmp_path / "w")
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.put(
                    f"{url}/admin/weights/1/chunks/0", data=b"abc", headers={"X-Sha256": _sha(b"abc")}
                ) as r,
            ):
                assert r.status == 400 and "X-Offset" in await r.text()
            with pytest.raises(WeightTransferError, match="could not publish version 0"):
                await publish(b"abc", 0, url + "/no-such-prefix", "", attempts=2)  # 404: not retried
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_admin_inputs_of_the_weight_routes_are_validated_and_answered_4xx(tmp_path: Path) -> None:
    """Versions are positive integers that only increase; chunks stay inside the size they declare;
    bodies that are not JSON objects are a 400, never a 500 (and nothing is written or loaded)."""
    async def go() -> None:
        runner, url, pool = await _serve(tmp_path)
        try:
            async with aiohttp.ClientSession() as http:
                data = b"x" * 100
                for bad in ("seven", "-3", "1.5"):
                    assert await _put(http, url, bad, 0, 0, data) == 400, bad  # type: ignore[arg-type]
                async with http.put(f"{url}/admin/weights/1/chunks/0", data=data,
                                    headers={"X-Sha256": _sha(data), "X-Offset": str(2**40)}) as r:
                    assert r.status == 400  # no 1 TiB sparse staging file
                async with http.put(
                    f"{url}/admin/weights/1/chunks/0",
                    data=data,
                    headers={"X-Sha256": _sha(data), "X-Offset": "0", "X-Total-Bytes": "50"},
                ) as r:
                    assert r.status == 400  # ends beyond the size it declares
                async with http.post(f"{url}/admin/weights/1/commit", data=b"not json") as r:
                    assert r.status == 400 and "error" in await r.json()
                async with http.post(f"{url}/admin/weights/nccl/init", json={"master_port": "x"}) as r:
                    assert r.status == 400
                assert (await publish(data, 1, url, "", chunk_bytes=64))["version"] == 1
                assert await _put(http, url, 1, 0, 0, data) == 409  # not newer than what the engines serve
            staged = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 2**30]
            assert not staged and pool.version == 1 and [v for v, _ in pool.loaded] == [1]
        finally:
            await runner.cleanup()

    asyncio.run(go())
