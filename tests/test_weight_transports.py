"""The learner's weight transport is chosen by ``weights.transport`` and says what it needs.

CPU only: the HTTP transport against serve's real receiver on loopback; the NCCL transport as far
as a machine without CUDA can take it (chosen, then refused with a clear error before serve is
asked for anything). The NCCL broadcast itself is tests/test_weight_sync_gpu.py (marker ``gpu``).
"""

from __future__ import annotations

import ast
import asyncio
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agentrl.config import LearnConfig, load
from agentrl.web import start_on_loopback
from agentrl.weights import (
    EnginesFailed,
    HttpTransport,
    HttpTransportConfig,
    NcclTransport,
    NcclTransportConfig,
    WeightGroupStale,
    WeightsConfig,
    WeightSyncError,
    WeightTransferError,
    WeightUpdateFailed,
    make_transport,
    serialize_state_dict,
)

ROOT = Path(__file__).resolve().parents[1]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@contextmanager
def fake_serve() -> Iterator[tuple[str, list[str]]]:
    """serve's /admin/info on loopback, in a thread of its own; yields its URL and the paths asked."""
    asked: list[str] = []
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def handle(request: web.Request) -> web.Response:
        asked.append(request.path)
        if request.path == "/admin/info":
            return web.json_response({"model_path": "/no/such/model", "version": 0, "model": "tiny"})
        return web.json_response({"error": {"message": "not in this stand-in"}}, status=500)

    async def main() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner, box["url"] = await start_on_loopback(app)
        box["stop"] = stop = asyncio.Event()
        box["loop"] = asyncio.get_running_loop()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield box["url"], asked
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)


def test_the_default_transport_is_http_and_wants_the_weights_in_host_memory() -> None:
    from agentrl.learner.source import ServeSource

    cfg = LearnConfig(admin_token="t")
    assert cfg.weights.transport == HttpTransportConfig() and cfg.weights.transport.kind == "http"
    source = ServeSource(cfg)
    assert isinstance(source.transport, HttpTransport) and source.weights_device == "cpu"


def test_a_learner_configured_for_nccl_builds_the_nccl_transport_and_without_cuda_says_what_it_needs(
        tmp_path: Path) -> None:
    if _cuda():
        pytest.skip("this machine has CUDA: the NCCL path runs in tests/test_weight_sync_gpu.py")
    import torch

    from agentrl.learner.source import ServeSource

    config = tmp_path / "learn.toml"
    config.write_text('admin_token = "t"\n\n[weights.transport]\nkind = "nccl"\nmaster_port = 29655\n')
    with fake_serve() as (url, asked):
        cfg = load(LearnConfig, config, [f"--serve={url}"])
        assert cfg.weights.transport == NcclTransportConfig(master_port=29655)
        source = ServeSource(cfg)
        assert isinstance(source.transport, NcclTransport) and source.weights_device == "cuda"

        async def go() -> None:
            try:
                await asyncio.wait_for(source.publish({"w": torch.zeros(2)}, 1), 30)  # never a hang
            finally:
                await source.close()

        with pytest.raises(WeightTransferError) as err:
            asyncio.run(go())
        assert not isinstance(err.value, EnginesFailed)  # not swallowed as "this version failed"
        message = str(err.value)
        assert 'weights.transport.kind = "nccl"' in message and "CUDA" in message
        assert 'weights.transport.kind = "http"' in message  # and what to use instead
        assert asked == []  # serve was never asked to have its engines join a group


def test_agentrl_learn_with_the_nccl_transport_stops_before_training_on_a_machine_without_cuda(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if _cuda():
        pytest.skip("this machine has CUDA")
    from agentrl.cli import main

    monkeypatch.setenv("AGENTRL_ADMIN_TOKEN", "t")
    with fake_serve() as (url, asked):
        with pytest.raises(SystemExit) as err:
            main(["learn", "--serve", url, f"--run_dir={tmp_path}", "--metrics_port=-1",
                  "--weights.transport.kind=nccl"])
    message = str(err.value.code)
    assert "weights.transport.kind = 'nccl'" in message and "CUDA" in message and '"http"' in message
    assert asked == ["/admin/info"]  # no batch was pulled, so nothing was trained or leased


def test_the_http_transport_sends_its_configured_chunks_and_serve_loads_the_state_dict_byte_for_byte(
        tmp_path: Path) -> None:
    import torch

    from tests.test_weight_transfer import _serve

    state = {"a.weight": torch.randn(64, 33), "b.bias": torch.arange(7, dtype=torch.float32)}
    expected = serialize_state_dict(state)

    async def go() -> None:
        runner, url, pool = await _serve(tmp_path / "w")
        transport = make_transport(HttpTransportConfig(chunk_bytes=1000, parallel_chunks=2), url, "")
        try:
            result = await transport.publish(state, 3)
        finally:
            await transport.close()
            await runner.cleanup()
        assert result["version"] == 3 and pool.loaded == [(3, expected)]
        assert len(expected) > 5 * 1000  # several chunks

    asyncio.run(go())


def test_an_unknown_transport_kind_is_refused_naming_the_known_ones() -> None:
    from agentrl.errors import ConfigError

    class Carrier:
        kind = "pigeon"

    from agentrl.weights.config import TRANSPORT_KINDS

    assert {"http", "nccl", "delta"} <= set(TRANSPORT_KINDS)
    with pytest.raises(ConfigError, match=re.escape(f"'pigeon' is not one of {list(TRANSPORT_KINDS)}")):
        make_transport(Carrier(), "http://127.0.0.1:1", "")  # type: ignore[arg-type]


def test_every_weight_sync_error_derives_from_one_root_under_agentrl_error() -> None:
    from agentrl.errors import AgentrlError

    assert issubclass(WeightSyncError, AgentrlError)
    for cls in (WeightTransferError, EnginesFailed, WeightUpdateFailed, WeightGroupStale):
        assert issubclass(cls, WeightSyncError), cls
    assert issubclass(EnginesFailed, WeightTransferError)
    assert WeightsConfig().transport.kind == "http"


def test_the_router_package_never_imports_the_weights_package() -> None:
    for path in sorted((ROOT / "agentrl" / "router").glob("*.py")):  # lazy imports inside functions too
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith("agentrl.weights")], (path.name, names)


def test_a_publish_serve_never_answered_is_ridden_out_and_a_refused_one_raises() -> None:
    from agentrl.learner.source import ServeSource

    class Transport:
        def __init__(self, error: WeightTransferError) -> None:
            self.error = error

        async def publish(self, state: dict, version: int) -> dict:
            raise self.error

    source = ServeSource.__new__(ServeSource)  # only its transport matters here
    source.transport = Transport(WeightTransferError("connection refused", None, unreachable=True))
    got = asyncio.run(source.publish({}, 8))  # serve restarting: the learner trains on
    assert got["unreachable"] and "connection refused" in got["error"]
    source.transport = Transport(WeightTransferError("413 too large", 413))
    with pytest.raises(WeightTransferError, match="413"):
        asyncio.run(source.publish({}, 9))


def test_a_publish_to_a_serve_that_is_not_listening_is_marked_unreachable() -> None:
    from agentrl.weights.transfer import publish
    from tests.conftest import free_port

    with pytest.raises(WeightTransferError) as err:
        asyncio.run(
            publish(b"weights", 1, f"http://127.0.0.1:{free_port()}", "token", attempts=1, timeout_s=10)
        )
    assert err.value.unreachable and err.value.status is None

