"""NCCL weight sync on a GPU machine: learner on cuda:0 broadcasts, a vLLM engine on cuda:1 receives.

Needs two GPUs and vLLM's CUDA build (never runs on the CPU build machines). Checks the whole path
as the learner takes it (``weights.transport.kind = "nccl"``: the transport ``make_transport``
builds, the weights gathered on the GPU by ``full_state_dict``), the group formed apart from
training, packed buckets, pause/receive/reset/version/resume through serve's routes, and that the
engine then computes the learner's logprobs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]


def _two_gpus() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() >= 2
    except ImportError:
        return False


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices (learner and engine on their own)")
def test_the_learner_broadcasts_new_weights_over_nccl_and_the_engine_serves_them(tiny_model: str,
                                                                                 tmp_path: Path) -> None:
    import aiohttp
    import torch
    from aiohttp import web
    from transformers import AutoModelForCausalLM

    from agentrl.engines.pool import EnginePool
    from agentrl.engines.vllm import EngineSpec, VLLMEngine
    from agentrl.learner.dist import Dist, full_state_dict
    from agentrl.learner.trainer import token_logprobs
    from agentrl.weights import (
        EngineUpdater,
        NcclTransport,
        NcclTransportConfig,
        WeightReceiver,
        make_transport,
    )

    spec = EngineSpec(model=tiny_model, served_name="tiny", port=free_port(), max_model_len=512, gpu=True,
                      env={"CUDA_VISIBLE_DEVICES": "1"}, extra_args=["--gpu-memory-utilization", "0.3"])
    engine = VLLMEngine(spec, tmp_path / "engine")
    engine.launch()
    torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).cuda()

    async def go() -> list[tuple[list[int], list[float], list[float]]]:
        await engine.start(timeout_s=900)
        pool = EnginePool([engine.url], health_interval_s=3600)
        await pool.start()
        updater = EngineUpdater(pool)
        await updater.start()
        app = web.Application()
        WeightReceiver(tmp_path / "weights", updater).add_routes(app, lambda request: None)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        transport = make_transport(NcclTransportConfig(master_address="127.0.0.1", master_port=free_port(),
                                                       packed_buffer_bytes=1 * 2**20),  # several buckets
                                   f"http://127.0.0.1:{port}", "")
        assert isinstance(transport, NcclTransport) and transport.device == "cuda"
        learner = Dist(device=torch.device("cuda", 0))
        checks = []
        try:
            for version in (1, 2):  # the first publish forms the group
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 0.05 * p.std())
                full = full_state_dict(model, learner, on_device=True)
                assert all(t.is_cuda for t in full.values())
                result = await transport.publish(full, version)
                assert result["version"] == version and result["failed"] == []
                async with aiohttp.ClientSession() as http:
                    async with http.get(engine.url + "/weight_info") as r:
                        assert (await r.json())["weight_version"] == str(version)
                    async with http.post(engine.url + "/v1/completions", json={
                            "model": "tiny", "prompt": "1 + 1 =", "max_tokens": 16, "temperature": 1.0,
                            "logprobs": 0, "return_token_ids": True}) as r:
                        out = await r.json()
                    async with http.get(engine.url + "/is_paused") as r:
                        assert not (await r.json())["is_paused"]
                choice = out["choices"][0]
                ids = choice.get("prompt_token_ids") or out["prompt_token_ids"]
                gen = choice["token_ids"]
                t = torch.tensor([ids + gen], device="cuda")
                with torch.no_grad():
                    ours = token_logprobs(model, t, torch.ones_like(t))[0, len(ids) - 1:].tolist()
                checks.append((gen, ours, choice["logprobs"]["token_logprobs"]))
        finally:
            await transport.close()
            await runner.cleanup()
            await pool.close()
        return checks

    try:
        checks: Any = asyncio.run(go())
    finally:
        engine.stop()
    for gen, ours, theirs in checks:
        assert len(gen) == len(ours) == len(theirs)
        assert sum(abs(a - b) for a, b in zip(ours, theirs, strict=True)) / len(gen) < 1e-3
