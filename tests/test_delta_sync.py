"""Delta weight sync without an engine: the encoding is lossless, serve applies a delta only to its
own base and only if it rebuilds bit for bit, and the transport falls back to the full weights.

The encode/apply tests use random tensors; the transport tests run the learner's
``DeltaTransport`` against serve's real ``WeightReceiver`` over loopback HTTP, with a recording
stand-in for the engine updater (the real engine: tests/test_delta_sync_vllm.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.config import LearnConfig, load
from agentrl.web import start_on_loopback
from agentrl.weights import DeltaError, DeltaTransport, DeltaTransportConfig, make_transport
from agentrl.weights.delta import apply_delta, cast_state, delta_metadata, encode_delta, state_digest
from tests.test_weight_sync import _serve as serve_receiver

BF16 = DeltaTransportConfig(dtype="bfloat16")  # the delta transport as serve-side tests use it


def random_state(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (300, 64), "layer.0.q.weight": (64, 64), "layer.0.norm.weight": (64,),
              "big.weight": (3, 70_000), "scalar": ()}
    return {k: (torch.randn(s, generator=g) * 0.02).to(dtype) for k, s in shapes.items()}


def learner_step(master: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """An Adam-sized step on fp32 master weights: every element moves by about ``lr``."""
    g = torch.Generator().manual_seed(seed)
    return {k: v - lr * torch.sign(torch.randn(v.shape, generator=g)) for k, v in master.items()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))
        for k in a
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_delta_rebuilds_the_new_state_bit_for_bit_and_sends_only_what_changed(dtype: str) -> None:
    master = random_state()
    base = cast_state(master, dtype)
    new = cast_state(learner_step(master, 1e-6, seed=1), dtype)
    # all of it changed: sent whole
    new["layer.0.q.weight"] = torch.randn(64, 64).to(new["layer.0.q.weight"].dtype)
    new["layer.0.norm.weight"] = base["layer.0.norm.weight"].clone()  # nothing changed: not sent
    new["scalar"] = -base["scalar"]
    data, stats = encode_delta(base, new, 3, 4)
    rebuilt = apply_delta(base, data, 3)
    assert same_bits(rebuilt, new)
    assert same_bits(base, cast_state(master, dtype))  # not changed in place unless asked
    meta = delta_metadata(data)
    assert meta["base"] == "3" and meta["version"] == "4" and meta["digest"] == state_digest(new)
    assert stats.changed_tensors == 4 and stats.dense_tensors >= 1
    full = sum(t.numel() * t.element_size() for t in new.values())
    if dtype == "bfloat16":  # at lr 1e-6 few bf16 elements change
        assert stats.changed_elements < 0.2 * stats.elements
        assert len(data) < 0.4 * full
    else:  # in fp32 nearly every element changes, and the delta is about the full size
        assert stats.changed_elements > 0.9 * stats.elements and len(data) > 0.9 * full


def test_signed_zeros_count_as_changes_so_the_result_is_bitwise_equal() -> None:
    base = {"w": torch.zeros(10, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][3] = -0.0
    data, stats = encode_delta(base, new, 0, 1)
    assert stats.changed_elements == 1 and same_bits(apply_delta(base, data, 0), new)


def test_an_unchanged_state_is_an_empty_delta_that_applies() -> None:
    base = cast_state(random_state(), "bfloat16")
    data, stats = encode_delta(base, base, 1, 2)
    assert stats.changed_tensors == 0 and same_bits(apply_delta(base, data, 1), base)


def test_a_delta_against_another_base_is_refused() -> None:
    base = cast_state(random_state(), "bfloat16")
    data, _ = encode_delta(base, cast_state(learner_step(random_state(), 1e-3, 2), "bfloat16"), 5, 6)
    with pytest.raises(DeltaError, match="against version 5; the engines hold 4") as err:
        apply_delta(base, data, 4)
    assert err.value.code == "base_mismatch" and err.value.status == 409


def test_a_corrupted_delta_is_refused_by_the_digest() -> None:
    base = cast_state(random_state(), "bfloat16")
    # sparse: the result depends on the base
    new = cast_state(learner_step(random_state(), 1e-5, 2), "bfloat16")
    data, _ = encode_delta(base, new, 1, 2)
    bad = bytearray(data)
    bad[-1] ^= 0x01  # one bit of the last tensor's bytes
    with pytest.raises(DeltaError, match="does not match the learner's digest") as err:
        apply_delta(base, bytes(bad), 1)
    assert err.value.code == "digest_mismatch"
    # and applied to a base it was not made from (same version number), the digest says so too
    other = cast_state(random_state(seed=9), "bfloat16")
    with pytest.raises(DeltaError, match="digest"):
        apply_delta(other, data, 1)


def test_malformed_deltas_are_clear_errors() -> None:
    base = cast_state(random_state(), "bfloat16")
    new = cast_state(learner_step(random_state(), 1e-3, 2), "bfloat16")
    data, _ = encode_delta(base, new, 1, 2)
    with pytest.raises(DeltaError, match="no safetensors header"):
        apply_delta(base, b"abc", 1)
    with pytest.raises(DeltaError, match="not safetensors JSON|header says"):
        apply_delta(base, b"\x08\x00\x00\x00\x00\x00\x00\x00not json", 1)
    smaller = dict(base, **{"embed.weight": base["embed.weight"][:10]})
    with pytest.raises(DeltaError, match="embed.weight"):
        apply_delta(smaller, data, 1)
    wrong_dtype = dict(base, **{"big.weight": base["big.weight"].float()})
    with pytest.raises(DeltaError, match="big.weight"):
        apply_delta(wrong_dtype, data, 1)
    with pytest.raises(DeltaError, match="names 'embed.weight::full', which is no part"):
        apply_delta({k: v for k, v in base.items() if k != "embed.weight"}, data, 1)
    with pytest.raises(DeltaError, match="differ from the base"):
        encode_delta(base, {k: v for k, v in new.items() if k != "scalar"}, 1, 2)
    with pytest.raises(DeltaError, match="scalar"):
        encode_delta(base, dict(new, scalar=new["scalar"].float()), 1, 2)


class FilePool:
    """The engine updater's place: records each version's file as the engines would load it."""

    def __init__(self) -> None:
        self.version = 0
        self.weights_path: str | None = None
        self.loaded: list[tuple[int, dict[str, torch.Tensor]]] = []

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        from safetensors.torch import load_file

        self.loaded.append((version, load_file(str(Path(path) / "model.safetensors"))))
        self.version, self.weights_path = version, path
        return {"version": version, "engines": {}, "failed": []}


@contextlib.asynccontextmanager
async def delta_served(
    pool: Any, root: Path, cfg: DeltaTransportConfig
) -> AsyncIterator[tuple[str, DeltaTransport]]:
    """serve's weight receiver over ``pool`` (writing under ``root``) and a delta transport to it."""
    runner, url = await serve_receiver(pool, root)
    transport = DeltaTransport(cfg, url, "")
    try:
        yield url, transport
    finally:
        await transport.close()
        await runner.cleanup()


def test_the_transport_sends_full_then_deltas_and_serve_writes_full_versions_equal_to_the_learners(
        tmp_path: Path) -> None:
    async def go() -> None:
        pool = FilePool()
        runner, url = await serve_receiver(pool, tmp_path / "w")  # type: ignore[arg-type]
        transport = make_transport(DeltaTransportConfig(dtype="bfloat16", chunk_bytes=64 * 1024), url, "")
        assert isinstance(transport, DeltaTransport)
        try:
            master = random_state()
            kinds = []
            for v in range(1, 5):
                master = learner_step(master, 1e-6, v)
                result = await transport.publish(master, v)
                kinds.append(result["transport"]["kind"])
                assert result["version"] == v and pool.version == v
                # what serve wrote, bitwise
                assert same_bits(pool.loaded[-1][1], cast_state(master, "bfloat16"))
            assert kinds == ["full", "delta", "delta", "delta"]
            assert result["transport"]["bytes"] < 0.5 * sum(t.numel() * 2 for t in master.values())
            assert not list((tmp_path / "w").glob("*.staging"))
        finally:
            await transport.close()
            await runner.cleanup()

    asyncio.run(go())


def test_a_delta_serve_cannot_apply_is_refused_with_409_and_the_full_weights_land(tmp_path: Path) -> None:
    import aiohttp

    async def go() -> None:
        pool = FilePool()
        async with delta_served(pool, tmp_path / "w", BF16) as (url, transport):
            master = random_state()
            await transport.publish(master, 1)
            pool.version = 2  # the engines moved on without this learner (another writer, a restore)
            # a delta against version 1, asked for directly: a clear 409 naming both versions
            data, _ = encode_delta(
                transport.base, cast_state(learner_step(master, 1e-5, 7), "bfloat16"), 1, 3
            )  # type: ignore[arg-type]
            from agentrl.weights import publish
            from agentrl.weights.errors import DeltaRefused

            with pytest.raises(DeltaRefused, match="against version 1; the engines hold version 2") as err:
                await publish(data, 3, url, "", commit_route="delta",
                              commit_fields={"base": 1, "digest": delta_metadata(data)["digest"]})
            assert err.value.status == 409 and err.value.code == "base_mismatch"
            assert pool.version == 2 and not (tmp_path / "w" / "v3").exists()
            # the transport: its delta is refused, and it sends the full weights instead
            master = learner_step(master, 1e-5, 8)
            result = await transport.publish(master, 3)
            assert result["transport"] == {"kind": "full", "why": "refused (base_mismatch)",
                                           "bytes": result["transport"]["bytes"]}
            assert pool.version == 3 and same_bits(pool.loaded[-1][1], cast_state(master, "bfloat16"))
            master = learner_step(master, 1e-5, 9)
            assert (await transport.publish(master, 4))["transport"]["kind"] == "delta"  # and deltas again
            async with aiohttp.ClientSession() as http, http.post(f"{url}/admin/weights/5/delta",
                                                                  json={"chunks": 1}) as r:
                assert r.status == 400 and "base" in (await r.json())["error"]["message"]

    asyncio.run(go())


def test_full_every_sends_the_full_weights_at_that_interval(tmp_path: Path) -> None:
    async def go() -> list[str]:
        pool = FilePool()
        async with delta_served(
            pool, tmp_path / "w", DeltaTransportConfig(dtype="float32", full_every=3)
        ) as (url, transport):
            master, kinds = random_state(), []
            for v in range(1, 8):
                master = learner_step(master, 1e-2, v)
                kinds.append((await transport.publish(master, v))["transport"]["kind"])
                assert same_bits(pool.loaded[-1][1], cast_state(master, "float32"))
            return kinds

    assert asyncio.run(go()) == ["full", "delta", "delta", "full", "delta", "delta", "full"]


def test_the_delta_transport_is_chosen_in_config_and_auto_asks_serve_for_the_engines_dtype(
    tmp_path: Path,
) -> None:
    cfg = load(LearnConfig, None, ["--weights.transport.kind=delta", "--weights.transport.full_every=10"])
    assert cfg.weights.transport == DeltaTransportConfig(full_every=10)
    with pytest.raises(ValueError, match="full_every"):
        DeltaTransportConfig(full_every=-1)
    from tests.test_weight_transports import fake_serve

    with fake_serve() as (url, asked):  # a serve that reports no engine dtype
        from agentrl.errors import ConfigError

        transport = DeltaTransport(DeltaTransportConfig(), url, "")
        with pytest.raises(ConfigError, match="weights.transport.dtype"):
            asyncio.run(transport.publish(random_state(), 1))
        assert asked == ["/admin/info"]


def test_when_no_engine_takes_a_delta_the_base_stays_and_the_next_delta_is_against_it(tmp_path: Path) -> None:
    from agentrl.weights import EnginesFailed, WeightUpdateFailed

    class FailingOnce(FilePool):
        fail = False

        async def update_weights(self, path: str, version: int) -> dict[str, Any]:
            if self.fail:
                self.fail = False
                raise WeightUpdateFailed(version, {"engine-0": {"error": "reload failed", "url": "x"}})
            return await super().update_weights(path, version)

    async def go() -> None:
        pool = FailingOnce()
        async with delta_served(pool, tmp_path / "w", BF16) as (url, transport):
            master = random_state()
            await transport.publish(master, 1)
            pool.fail = True
            with pytest.raises(EnginesFailed):
                await transport.publish(learner_step(master, 1e-6, 2), 2)
            assert pool.version == 1 and transport.base_version == 1 and not (tmp_path / "w" / "v2").exists()
            master = learner_step(master, 1e-6, 3)
            result = await transport.publish(master, 3)
            assert result["transport"]["kind"] == "delta" and result["transport"]["base"] == 1
            assert same_bits(pool.loaded[-1][1], cast_state(master, "bfloat16"))

    asyncio.run(go())


def test_auto_takes_the_engines_dtype_serve_reports(tmp_path: Path) -> None:
    from aiohttp import web

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"version": 0, "engine_dtype": "bfloat16"})  # what serve's /admin/info says

    async def go() -> str | None:
        app = web.Application()
        app.router.add_get("/admin/info", info)
        runner, url = await start_on_loopback(app)
        try:
            transport = DeltaTransport(DeltaTransportConfig(), url, "")
            return await transport._engine_dtype()
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == "bfloat16"
