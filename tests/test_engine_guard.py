"""An engine serve launched answers only serve: its control routes (pause, collective_rpc, version)
and its chat routes refuse any request without the run's engine key, so no other local process can
pause it, load other weights into it, or chat past the router's capture."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from agentrl.engines.guard import EngineGuard
from tests.conftest import free_port


def test_the_guard_refuses_a_request_without_the_key_and_passes_one_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENTRL_ENGINE_KEY", "k3y")
    seen: list[str] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        seen.append(scope["path"])

    sent: list[dict] = []

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    guard = EngineGuard(app)

    async def go() -> None:
        for path, headers in [("/pause", []), ("/collective_rpc", [(b"authorization", b"Bearer wrong")]),
                              ("/health", []), ("/pause", [(b"authorization", b"bearer k3y")])]:
            await guard({"type": "http", "path": path, "headers": headers}, None, send)  # type: ignore[arg-type]

    asyncio.run(go())
    assert seen == ["/health", "/pause"]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [401, 401]


@pytest.mark.vllm
def test_a_launched_engine_answers_only_with_its_key(tiny_tools_model: str, tmp_path: Path) -> None:
    from agentrl.engines.vllm import EngineSpec, VLLMEngine
    from agentrl.router import EnginePool

    spec = EngineSpec(model=tiny_tools_model, served_name="tiny-tools", port=free_port(), max_model_len=512,
                      api_key="engine-key-of-this-run")
    assert "engine-key-of-this-run" not in " ".join(spec.command())  # the key is in the environment only
    engine = VLLMEngine(spec, tmp_path)
    engine.launch()

    async def go() -> dict[str, int]:
        await engine.start(timeout_s=600)
        out: dict[str, int] = {}
        async with aiohttp.ClientSession() as http:
            for name, method, path, body in [
                ("pause", "POST", "/pause?mode=keep", None),
                ("version", "POST", "/update_weight_version", {"new_version": "7"}),
                (
                    "rpc",
                    "POST",
                    "/collective_rpc",
                    {"method": "reload_weights", "kwargs": {"weights_path": "/tmp"}},
                ),
                (
                    "chat",
                    "POST",
                    "/v1/chat/completions",
                    {"model": "tiny-tools", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                ),
                ("generate", "POST", "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {}}),
            ]:
                async with http.request(method, engine.url + path, json=body) as r:
                    out[name] = r.status
            async with http.get(engine.url + "/health") as r:
                out["health"] = r.status
        pool = EnginePool([engine.url], api_key="engine-key-of-this-run")
        await pool.start()
        try:
            got = await pool.call(
                pool.engines[0],
                "/v1/chat/completions",
                {"model": "tiny-tools", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            )
            out["through_the_pool"] = 200 if got.get("choices") else 0
            await pool.control(pool.engines[0], "/resume")  # control calls carry the key too
            out["control_through_the_pool"] = 200
        finally:
            await pool.close()
        return out

    try:
        codes = asyncio.run(go())
    finally:
        engine.stop()
    assert {k: codes[k] for k in ("pause", "version", "rpc", "chat", "generate")} == dict.fromkeys(
        ("pause", "version", "rpc", "chat", "generate"), 401), codes
    assert (
        codes["health"] == 200
        and codes["through_the_pool"] == 200
        and codes["control_through_the_pool"] == 200
    )
    assert os.environ.get("AGENTRL_ENGINE_KEY") is None
