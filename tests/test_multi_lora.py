"""Multi-LoRA on serve's side, without vLLM: named policies in the config, the router's choice of a
policy by ``model``, one buffer stream per policy with its own staleness bound, and each policy's
own adapter uploads, versions and kept window. The engines are fakes here; the same choice of
adapter on a real vLLM engine is tests/test_lora_vllm.py, and a run training two policies is
tests/test_multi_lora_run.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from agentrl.buffer import BufferClient, PolicyBuffers, Sample, add_buffer_routes
from agentrl.buffer.config import BufferConfig
from agentrl.config import ConfigError, RunConfig, load
from agentrl.errors import TransportError
from agentrl.web import start_on_loopback
from agentrl.weights import WeightReceiver, WeightTransferError, publish


def _sample(policy: str, group: str, version: int, i: int = 0) -> Sample:
    n = 6
    return Sample(np.arange(n), np.array([0, 0, 1, 1, 1, 1]), np.zeros(n, np.float32), np.full(n, version),
                  episode_id=f"{group}-{i}", group_id=group, env="e", reward=float(i),
                  info={"policy": policy} if policy else {})


def test_named_policies_are_checked_and_agentrl_run_loads_every_kept_adapter() -> None:
    cfg = load(RunConfig, overrides=["learn.lora.rank=8", "serve.buffer.max_staleness=1",
                                     "serve.policies.proposer.max_staleness=3", "serve.policies.solver={}"])
    assert cfg.serve.staleness() == {"proposer": 3, "solver": 1}
    assert cfg.serve.engine.max_loras >= 4 + 2  # every version a sample may come from, of both
    for bad, why in ((["serve.policies.Bad={}"], "lowercase"), (["serve.policies.default={}"], "default"),
                     (["serve.policies.a.max_staleness=-2"], "max_staleness"), ([], "lora_rank")):
        with pytest.raises(ConfigError, match=why):
            load(RunConfig, overrides=(["learn.lora.rank=8"] if bad else []) + bad + (
                ["serve.policies.a={}"] if not bad else []))


def two_streams(max_staleness: int, versions: dict[str, int]) -> PolicyBuffers:
    """Streams per policy at ``versions``, batches of 2 samples in groups of 2."""
    return PolicyBuffers(BufferConfig(batch_size=2, group_size=2, max_staleness=max_staleness), versions)


def test_each_policy_has_its_own_stream_staleness_bound_and_room() -> None:
    async def go() -> None:
        buf = two_streams(1, {"proposer": 0, "solver": 2})
        try:
            await buf.put([_sample("solver", "g1", 0, i) for i in range(2)] +
                          [_sample("proposer", "g2", 0, i) for i in range(2)] +
                          [_sample("", "g3", 0, i) for i in range(2)])  # names none: the default's (proposer)
            st = buf.stats()
            assert st["policies"]["solver"]["pending"] == 2 and st["policies"]["proposer"]["pending"] == 4
            assert st["pending"] == 6 and st["identity_holds"]
            # a solver batch holds solver samples only, and is within the solver's own bound at version 2
            batch = await buf.get_batch(2, batch_size=2, policy="solver")
            assert batch is not None and {s.info["policy"] for s in batch.samples} == {"solver"}
            assert buf.ack(batch.batch_id)
            # the proposer's bound is 0: at learner version 1 its version-0 samples are all stale
            assert await buf.get_batch(1, max_staleness=0, batch_size=2, policy="proposer") is None
            assert buf.stats()["policies"]["proposer"]["dropped_by_reason"] == {"stale": 4}
            with pytest.raises(ValueError, match="critic"):
                buf.stream("critic")
            # room: (0 + 1) x 2 + (2 + 1) x 2 = 8 samples in all, none held now
            assert buf.in_flight_allowance(3) == 5
        finally:
            buf.close()

    asyncio.run(go())


def test_the_buffer_routes_serve_a_named_policys_stream_and_refuse_an_unknown_one(tmp_path: Path) -> None:
    async def go() -> None:
        buf = PolicyBuffers(BufferConfig(path=str(tmp_path / "buffer"), batch_size=2, group_size=2),
                            {"proposer": 1, "solver": 1})
        app = web.Application()
        add_buffer_routes(app, buf, "tok")
        runner, url = await start_on_loopback(app)
        client = BufferClient(url, "tok")
        try:
            await client.put([_sample("solver", "g1", 0, i) for i in range(2)])
            assert await client.get_batch(0, timeout_s=0.2, policy="proposer") is None
            got = await client.get_batch(0, timeout_s=0.2, policy="solver")
            assert got is not None and [s.info["policy"] for s in got.samples] == ["solver", "solver"]
            assert await client.ack(got.batch_id)
            with pytest.raises(TransportError) as e:  # a 400 naming the policy
                await client.get_batch(0, timeout_s=0.2, policy="critic")
            assert e.value.status == 400 and "critic" in str(e.value)
        finally:
            await client.close()
            await runner.cleanup()
            buf.close()
        assert (tmp_path / "buffer" / "solver").is_dir() and (tmp_path / "buffer" / "proposer").is_dir()

    asyncio.run(go())


def test_each_policy_uploads_its_own_adapters_with_its_own_versions_and_window(tiny_model: str,
                                                                              tmp_path: Path) -> None:
    from agentrl.learner.lora import adapter_config
    from agentrl.weights.adapters import pack_adapter
    from tests.test_lora import _adapted, adapter_state
    from tests.test_weight_sync import _close, _pool

    model, cfg = _adapted(tiny_model)
    data = pack_adapter(adapter_state(model.state_dict()), adapter_config(cfg))

    async def go() -> None:
        pool, up, fakes = await _pool(1)
        up.default_policy, up.keep = "proposer", {"proposer": 2, "solver": 1}
        app = web.Application(client_max_size=2**30)
        receivers: dict[str, Any] = {}
        for name in ("proposer", "solver"):
            receivers[name] = WeightReceiver(tmp_path / name, up.policy(name), adapters_only=True)
            receivers[name].add_routes(app, lambda request: None, prefix=f"/admin/policies/{name}/weights")
        runner, url = await start_on_loopback(app)
        try:
            for v in (1, 2):
                await publish(data, v, url, "", kind="adapter", policy="solver")
            await publish(data, 1, url, "", kind="adapter", policy="proposer")
            assert pool.version == 1 and pool.versions == {"solver": 2}
            engine = pool.engines[0]
            assert engine.adapters == {"solver": {2: str(tmp_path / "solver" / "v2")},
                                       "proposer": {1: str(tmp_path / "proposer" / "v1")}}
            assert engine.adapter("solver") == ("solver-v2", 2) and engine.adapter("proposer") == (
                "proposer-v1",
                1,
            )
            unloads = [b["lora_name"] for _, p, b in fakes[0].calls if p == "/v1/unload_lora_adapter"]
            assert unloads == ["solver-v1"]  # the solver keeps 1; the proposer's v1 is untouched
            with pytest.raises(WeightTransferError) as e:  # a version a policy already has: 409
                await publish(data, 2, url, "", kind="adapter", policy="solver")
            assert e.value.status == 409
            with pytest.raises(WeightTransferError) as e:  # full weights are not a LoRA policy's: 400
                await publish(b"\0" * 64, 3, url, "", kind="full", policy="solver")
            assert e.value.status == 400 and pool.versions == {"solver": 2}
            # an engine that comes back gets every policy's kept adapters
            engine.adapters.clear()
            assert await up.rejoin(engine)
            assert engine.adapters == {"solver": {2: str(tmp_path / "solver" / "v2")},
                                       "proposer": {1: str(tmp_path / "proposer" / "v1")}}
        finally:
            await runner.cleanup()
            await _close(pool, fakes)

    asyncio.run(go())


def test_the_router_takes_the_policy_from_model_and_a_sample_never_spans_two() -> None:
    from agentrl.router.sessions import CallRecord, Completion, Session

    class R:  # the router's policy choice alone
        from agentrl.router.core import Router

        policies = ["proposer", "solver"]
        model_name = "tiny"
        serves_base = False
        named_policy = Router.named_policy
        policy_of = Router.policy_of

    r = R()
    assert r.policy_of({"model": "solver", "messages": []}) == ({"model": "tiny", "messages": []}, "solver")
    assert r.policy_of({"model": "tiny"})[1] == "proposer" and r.policy_of({})[1] == "proposer"
    # refused later as an unknown model
    assert r.named_policy({"model": "critic"}) == ({"model": "critic"}, None)
    # "base" (a frozen role) is the base weights only where the engines serve LoRA adapters beside them
    assert r.named_policy({"model": "base"}) == ({"model": "base"}, None)
    r.serves_base = True
    assert r.named_policy({"model": "base"}) == ({"model": "tiny"}, "base")

    reply = {"role": "assistant", "content": "hi"}
    first = [{"role": "user", "content": "a"}]
    s = Session("s")
    s.record(CallRecord("s", 0, None, 0, [1, 2], [Completion([3], [-0.1], [1], "stop", reply)], "e",
                        messages=first, policy="proposer"))
    follow = [*first, reply, {"role": "user", "content": "b"}]
    assert s.find_parent(follow, "proposer") is not None
    assert s.find_parent(follow, "solver") is None  # another policy's call starts its own sample
    s.record(CallRecord("s", 1, None, 0, [1, 2, 3, 4], [Completion([5], [-0.2], [4], "stop", reply)], "e",
                        messages=follow, policy="solver"))
    assert [x.info["policy"] for x in s.samples()] == ["proposer", "solver"]


def test_metrics_carry_each_policys_version_and_stream() -> None:
    from agentrl.serve.app import prometheus_series

    out = prometheus_series(
        {
            "policies": {"proposer": 3, "solver": 5},
            "buffer": {
                "pending": 7,
                "policies": {"solver": {"depth": 4, "pending": 4, "consumed": 8, "dropped": 1}},
            },
        }
    )
    assert out['policy_version{policy="proposer"}'] == 3 and out['policy_version{policy="solver"}'] == 5
    assert out['buffer_policy_depth{policy="solver"}'] == 4 and out["buffer_pending"] == 7


def test_a_producer_waiting_for_room_is_woken_by_any_streams_consumed_batch() -> None:
    async def go() -> None:
        buf = two_streams(0, {"proposer": 0, "solver": 0})
        try:
            await buf.put([_sample("solver", "g1", 0, i) for i in range(2)] +
                          [_sample("proposer", "g2", 0, i) for i in range(2)])
            assert await buf.wait_for_room(0, 0.05) == 0  # (0 + 1) x 2 per stream, both full
            waiting = asyncio.create_task(buf.wait_for_room(0, 30.0))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            batch = await buf.get_batch(0, batch_size=2, policy="solver")
            assert batch is not None and buf.ack(batch.batch_id)
            assert await asyncio.wait_for(waiting, 5.0) == 2
        finally:
            buf.close()

    asyncio.run(go())


def test_a_playing_environment_names_a_policy_per_call_and_other_model_names_are_dropped() -> None:
    from agentrl.rollout.config import EpisodeLimits
    from agentrl.rollout.episode import EpisodeResult, SessionModel

    class Client:
        model_name, policies = "tiny", ["proposer", "solver"]

        def __init__(self) -> None:
            self.bodies: list[dict[str, Any]] = []

        async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
            self.bodies.append(body)
            return {"choices": [{"message": {"role": "assistant", "content": "x"}, "token_ids": [1]}]}

    async def go() -> list[Any]:
        client = Client()
        ep = EpisodeResult("e", "g", "env", "t")
        seat = SessionModel(client, ep, EpisodeLimits(max_turns=9), policy="solver")  # the task's policy
        for model in ("proposer", "gpt-4o", None):
            await seat.chat({"messages": [], **({"model": model} if model else {})})
        plain = SessionModel(client, ep, EpisodeLimits(max_turns=9))
        await plain.chat({"messages": [], "model": "gpt-4o"})
        return [b.get("model") for b in client.bodies]

    assert asyncio.run(go()) == ["proposer", "solver", "solver", None]
