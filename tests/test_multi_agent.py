"""Multi-agent episodes without an engine: the bindings' config checks, what a misbehaving
environment gets, the graph a fake client's calls build, and per-role advantages.

The engine-backed checks (exact samples per branch, the frozen base, an external endpoint) are in
``tests/test_multi_agent_vllm.py``; here the chat client is a stand-in that answers every call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

import agentrl
from agentrl.buffer.sample import Sample
from agentrl.env.base import Played, Reset
from agentrl.env.roles import Agent, MultiAgentEnv
from agentrl.errors import ConfigError
from agentrl.rollout.config import EpisodeLimits, RoleBinding
from agentrl.rollout.episode import run_episode
from agentrl.router.sessions import SessionSummary


class Answering:
    """A chat client whose every call answers "ok" (stand-in for the router in these unit tests)."""

    model_name = "m"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.begun: list[str] = []
        self.ended: list[str] = []
        self.bodies: list[tuple[str | None, dict[str, Any]]] = []

    async def begin(self, session_id: str, **meta: Any) -> None:
        self.begun.append(session_id)

    async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
        await asyncio.sleep(float(body.get("delay_s", 0)))
        self.bodies.append((session_id, body))
        i = self.calls[session_id or ""] = self.calls.get(session_id or "", -1) + 1
        return {"choices": [{"message": {"role": "assistant", "content": "ok"}, "token_ids": [1, 2],
                             "finish_reason": "stop"}],
                "agentrl": {"session_id": session_id, "call_index": i, "versions": [[3, 3]]}}

    async def end(self, session_id: str) -> SessionSummary | None:
        self.ended.append(session_id)
        return SessionSummary(session_id, [])


class Pair(MultiAgentEnv):
    roles = ("a", "b")
    mode = "ok"

    def tasks(self, split: str = "train") -> Iterator[dict[str, Any]]:
        return iter([{"id": "t0"}])

    async def reset(self, task: dict[str, Any]) -> Reset:
        return Reset(messages=[{"role": "user", "content": "go"}])

    async def play_roles(self, task: dict[str, Any], agents: Mapping[str, Agent]) -> Played:
        msg = {"messages": [{"role": "user", "content": "hi"}], "model": "mine"}
        a = agents["a"]
        await a.chat(msg)
        await a.chat(msg)
        subs = [a.fork("b"), a.fork()]
        await asyncio.gather(*(s.chat(msg) for s in subs))
        a.compact()
        await a.chat(msg)
        if self.mode == "fork_unknown":
            a.fork("nobody")
        if self.mode == "stray":  # a sub-agent started and never awaited
            Pair.stray = asyncio.create_task(a.fork("b").chat(dict(msg, delay_s=60)))
            await asyncio.sleep(0.05)
        rewards = {"a": 1.0, "ghost": 2.0} if self.mode == "unknown_reward" else {"a": 1.0}
        return Played(reward=0.5, role_rewards=rewards)


@pytest.fixture(autouse=True)
def _registered() -> Iterator[None]:
    agentrl.environment("test_pair")(Pair)
    yield
    agentrl.env.registry.unregister("test_pair")
    Pair.mode = "ok"


def play(bindings: dict[str, RoleBinding] | None = None) -> tuple[Any, Answering]:
    client = Answering()
    ep = asyncio.run(run_episode(client, "test_pair", {"id": "t0"}, group_id="g", roles=bindings,
                                 limits=EpisodeLimits(max_turns=8)))
    return ep, client


def test_the_calls_build_the_episode_graph_with_turn_fork_and_compaction_edges() -> None:
    ep, client = play({"b": RoleBinding(policy="bee")})
    assert ep.error is None and ep.terminated and ep.turns == 5
    nodes = ep.info["graph"]["nodes"]
    assert [(n["role"], n["parent"], n["edge"]) for n in nodes[:2]] == [("a", None, None), ("a", 0, "turn")]
    forks = sorted((n["role"], n["parent"], n["edge"]) for n in nodes[2:4])
    assert forks == [("a", 1, "fork"), ("b", 1, "fork")]
    assert (nodes[4]["role"], nodes[4]["parent"], nodes[4]["edge"]) == ("a", 1, "compaction")
    assert all(n["versions"] == [3] and n["trained"] for n in nodes)
    # each role its own session; the binding, not the environment, picks the model
    sid = ep.episode_id
    assert set(client.begun) == {sid, f"{sid}.a", f"{sid}.b"} and set(client.ended) == set(client.begun)
    assert {s: b.get("model") for s, b in client.bodies} == {f"{sid}.a": None, f"{sid}.b": "bee"}
    assert ep.info["role_rewards"] == {"a": 1.0}


@pytest.mark.parametrize(("mode", "says"), [("unknown_reward", "ghost"), ("fork_unknown", "nobody")])
def test_rewards_or_a_fork_for_an_undeclared_role_fail_the_episode_as_the_environments(mode: str,
                                                                                      says: str) -> None:
    Pair.mode = mode
    ep, client = play()
    assert ep.error_kind == "environment" and says in ep.error
    assert set(client.ended) == set(client.begun)  # every session it opened is closed
    assert len(ep.samples) == 1 and ep.samples[0].error  # its group stays countable, nothing trains


def test_a_branch_never_awaited_fails_the_episode_and_is_cancelled_with_it() -> None:
    Pair.mode = "stray"
    t0 = time.monotonic()
    ep, client = play()
    assert ep.error_kind == "environment" and "never awaited" in ep.error, ep.error
    assert time.monotonic() - t0 < 30  # the stray call did not hold the episode for its 60 s
    assert Pair.stray.cancelled()
    assert set(client.ended) == set(client.begun)


def test_a_binding_for_a_role_the_environment_does_not_declare_fails_the_episode() -> None:
    ep, _ = play({"c": RoleBinding()})
    assert ep.error_kind == "environment" and "'c'" in ep.error


def test_frozen_roles_ask_for_the_base_model_and_record_no_samples() -> None:
    ep, client = play({"b": RoleBinding(frozen=True)})
    assert ep.error is None
    assert {b.get("model") for s, b in client.bodies if s.endswith(".b")} == {"base"}
    assert [n["trained"] for n in ep.info["graph"]["nodes"] if n["role"] == "b"] == [False]


def _serve_config(**roles: RoleBinding) -> Any:
    from agentrl.serve.config import PolicyConfig, ServeConfig

    cfg = ServeConfig()
    cfg.env.name = "test_pair"
    cfg.engine.lora_rank = 8
    cfg.engine.max_loras = 12
    cfg.policies = {"bee": PolicyConfig()}
    cfg.env.roles = dict(roles)
    return cfg


@pytest.mark.parametrize(("roles", "lora", "says"), [
    ({"b": RoleBinding(policy="nope")}, 8, "not a policy of serve.policies"),
    ({"b": RoleBinding(policy="bee", frozen=True)}, 8, "without lag or version), frozen and"),
    ({"b": RoleBinding(lag=2, endpoint="http://x")}, 8, "without lag or version), frozen and"),
    ({"b": RoleBinding(lag=-1)}, 8, "lag must be between"),
    ({"b": RoleBinding(lag=2)}, 0, "engine.lora_rank > 0"),
    ({"b": RoleBinding(endpoint="ftp://x")}, 8, "http(s) base URL"),
    ({"B!": RoleBinding()}, 8, "a role's name"),
    ({"b": RoleBinding(frozen=True)}, 0, "engine.lora_rank > 0"),
    ({"b": RoleBinding(version=2)}, 0, "engine.lora_rank > 0"),
    ({"b": RoleBinding(version=-1)}, 8, "a published version (1 or more)"),
    ({"b": RoleBinding(version=2, lag=1)}, 8, "not both"),
    ({"b": RoleBinding(version=2, frozen=True)}, 8, "without lag or version), frozen and"),
    ({"b": RoleBinding(policy="nope", version=1)}, 8, "not a policy of serve.policies"),
])
def test_bindings_are_checked_at_start(roles: dict[str, RoleBinding], lora: int, says: str) -> None:
    cfg = _serve_config(**roles)
    cfg.engine.lora_rank = lora
    if not lora:
        cfg.policies = {}
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        cfg.check()


def test_a_role_the_environment_does_not_declare_is_a_config_error_before_anything_starts() -> None:
    from agentrl.serve.build import check_declared_roles

    check_declared_roles(_serve_config(b=RoleBinding(policy="bee")))
    with pytest.raises(ConfigError, match=r"\['c'\].*its roles: \['a', 'b'\]"):
        check_declared_roles(_serve_config(c=RoleBinding()))


def test_each_role_compares_with_its_own_role_in_the_group() -> None:
    from agentrl.learner.batch import prepare
    from agentrl.learner.config import LossConfig

    def sample(episode: str, role: str, reward: float) -> Sample:
        ids = np.arange(6, dtype=np.int32)
        return Sample(ids, np.array([0, 0, 1, 1, 1, 1], dtype=np.int32), np.zeros(6, np.float32),
                      np.zeros(6, np.int32), episode_id=episode, group_id="g", env="e", reward=reward,
                      info={"role": role})

    # the solver wins in e1, the proposer in e2: within each role one better episode, one worse
    batch = prepare([sample("e1", "solver", 1.0), sample("e1", "proposer", 0.0),
                     sample("e2", "solver", 0.0), sample("e2", "proposer", 1.0)], LossConfig())
    adv = batch.advantages.tolist()
    assert adv[0] > 0 and adv[1] < 0 and adv[2] < 0 and adv[3] > 0
    # pooled per episode (the rewards' mean, 0.5 each) there would be no signal at all
    pooled = prepare([sample("e1", "", 1.0), sample("e1", "", 0.0), sample("e2", "", 0.0),
                      sample("e2", "", 1.0)], LossConfig())
    assert pooled.advantages.abs().max() == 0


def test_a_lagged_role_keeps_its_policys_versions_loaded_and_asks_for_the_one_k_back() -> None:
    from agentrl.engines.pool import Engine
    from agentrl.router.request_rules import named_policy

    cfg = _serve_config(a=RoleBinding(lag=3), b=RoleBinding(policy="bee", lag=1))
    cfg.policies["solo"] = type(cfg.policies["bee"])(max_staleness=0)
    cfg.check()
    # the first named policy is the default: a's lag 3 widens it past its staleness bound (2)
    assert cfg.adapter_windows() == {"bee": 4, "solo": 1} and cfg.adapters_loaded() == 5
    ep, client = play({"a": RoleBinding(lag=3), "b": RoleBinding(policy="bee", lag=1)})
    assert {b.get("model") for _, b in client.bodies} == {"default:lag3", "bee:lag1"}
    assert not any(n["trained"] for n in ep.info["graph"]["nodes"])
    # the router: "<policy>:lag<k>" on LoRA engines only, "default" the first named policy
    body = {"model": "default:lag3"}
    assert named_policy(body, "m", ["bee", "solo"], base=True) == ({"model": "m"}, "bee:lag3")
    assert named_policy({"model": "solo:lag1"}, "m", ["bee", "solo"], base=True)[1] == "solo:lag1"
    assert named_policy({"model": "ghost:lag1"}, "m", ["bee"], base=True)[1] is None
    assert named_policy(body, "m", ["bee"], base=False)[1] is None
    assert named_policy(body, "m", [], base=True)[1] == "policy:lag3"  # the one unnamed policy
    # the engine: the version k before its newest, the base weights while there is none
    engine = Engine("http://x", "e")
    engine.adapters = {"bee": {3: "a", 4: "b", 5: "c"}}
    assert engine.adapter("bee") == ("bee-v5", 5)
    assert engine.adapter("bee:lag2") == ("bee-v3", 3)
    assert engine.adapter("bee:lag5") is None
    engine.adapters = {"bee": {1: "a"}}
    assert engine.adapter("bee:lag1") is None


def test_a_pinned_role_asks_for_its_policys_published_version_and_keeps_it_loaded() -> None:
    from agentrl.engines.pool import Engine
    from agentrl.router.request_rules import named_policy

    cfg = _serve_config(a=RoleBinding(version=2), b=RoleBinding(policy="bee", version=5),
                        c=RoleBinding(policy="solo", version=5))
    cfg.policies["solo"] = type(cfg.policies["bee"])(max_staleness=0)
    cfg.check()
    # the default policy (the first named) keeps versions 2 and 5 beside its window, solo its 5
    assert cfg.pinned_versions() == {"bee": {2, 5}, "solo": {5}}
    assert cfg.adapter_windows() == {"bee": 3, "solo": 1} and cfg.adapters_loaded() == 7
    cfg.engine.max_loras = 6
    with pytest.raises(ConfigError, match="must be at least 7"):
        cfg.check()
    ep, client = play({"a": RoleBinding(version=2), "b": RoleBinding(policy="bee", version=5)})
    assert {b.get("model") for _, b in client.bodies} == {"default:v2", "bee:v5"}
    nodes = ep.info["graph"]["nodes"]
    assert not any(n["trained"] for n in nodes)
    assert {(n["role"], n["sampler"]) for n in nodes} == {("a", "policy::v2"), ("b", "policy:bee:v5")}
    # the router: "<policy>:v<N>" on LoRA engines only, "default" the first named policy, N >= 1
    body = {"model": "default:v2"}
    assert named_policy(body, "m", ["bee", "solo"], base=True) == ({"model": "m"}, "bee:v2")
    assert named_policy({"model": "solo:v12"}, "m", ["bee", "solo"], base=True)[1] == "solo:v12"
    assert named_policy({"model": "ghost:v1"}, "m", ["bee"], base=True)[1] is None
    assert named_policy({"model": "bee:v0"}, "m", ["bee"], base=True)[1] is None
    assert named_policy({"model": "bee:v1"}, "m", ["bee"], base=False)[1] is None
    assert named_policy({"model": "default:v3"}, "m", [], base=True)[1] == "policy:v3"  # the one unnamed
    # the engine: exactly version N, whatever came after; the base weights until it is published
    engine = Engine("http://x", "e")
    engine.adapters = {"bee": {1: "a"}}
    assert engine.adapter("bee:v2") is None
    engine.adapters = {"bee": {2: "a", 4: "b", 5: "c"}}
    assert engine.adapter("bee:v2") == ("bee-v2", 2) and engine.adapter("bee") == ("bee-v5", 5)
    assert engine.adapter("bee:v5") == ("bee-v5", 5)
    assert engine.adapter("bee:v6") is None


def test_team_baseline_and_loss_weight_settings_shape_a_roles_advantages() -> None:
    from agentrl.learner.batch import prepare
    from agentrl.learner.config import LossConfig
    from agentrl.rollout.roles import RoleBaselines

    def sample(episode: str, role: str, reward: float, **info: Any) -> Sample:
        return Sample(np.arange(6, dtype=np.int32), np.array([0, 0, 1, 1, 1, 1], dtype=np.int32),
                      np.zeros(6, np.float32), np.zeros(6, np.int32), episode_id=episode, group_id="g",
                      env="e", reward=reward, info={"role": role, **info})

    adv = prepare([
        sample("e1", "judge", 0.9, advantage="baseline", baseline=0.5),  # no group: 0.9 - 0.5
        sample("e1", "a", 1.0, advantage="team"), sample("e1", "b", 1.0, advantage="team", loss_weight=0.5),
        sample("e2", "a", 0.0, advantage="team"), sample("e2", "b", 0.0, advantage="team", loss_weight=0.5),
    ], LossConfig()).advantages.tolist()
    assert adv[0] == pytest.approx(0.4)
    # both roles on the team reward form one comparison per episode; the weight halves b's
    assert adv[1] > 0 and adv[3] < 0
    assert adv[2] == pytest.approx(adv[1] / 2) and adv[4] == pytest.approx(adv[3] / 2)
    b = RoleBaselines(rate=0.5)
    assert [b.see("k", r) for r in (1.0, 0.0, 0.0)] == [1.0, 1.0, 0.5]


def test_the_bindings_advantage_settings_travel_on_the_roles_samples() -> None:
    from agentrl.rollout.roles import Cast, RoleBaselines
    from agentrl.router.sessions import SessionSummary

    class Recording(Answering):
        async def end(self, session_id: str) -> SessionSummary | None:
            self.ended.append(session_id)
            ids = np.arange(4, dtype=np.int32)
            s = Sample(ids, np.array([0, 0, 1, 1], np.int32), np.zeros(4, np.float32), np.zeros(4, np.int32),
                       episode_id=session_id, group_id="g", env="e", reward=0.0, info={"calls": [0]})
            return SessionSummary(session_id, [s])

    async def go() -> Any:
        from agentrl.rollout.episode import EpisodeResult

        ep = EpisodeResult("ep1", "g", "test_pair", "t0", reward=0.25)
        bindings = {"a": RoleBinding(advantage="team", loss_weight=2.0),
                    "b": RoleBinding(advantage="baseline")}
        cast = Cast(Recording(), ep, EpisodeLimits(max_turns=8), bindings, RoleBaselines())
        await cast.open(("a", "b"))
        agents = cast.agents(("a", "b"))
        for role in ("a", "b"):
            await agents[role].chat({"messages": [{"role": "user", "content": "hi"}]})
        cast.role_rewards = {"a": 1.0, "b": 0.75}
        await cast.finish()
        return ep

    ep = asyncio.run(go())
    by_role = {s.info["role"]: s for s in ep.samples}
    assert by_role["a"].reward == 0.25 and by_role["a"].info["advantage"] == "team"
    assert by_role["a"].info["loss_weight"] == 2.0
    assert by_role["b"].reward == 0.75 and by_role["b"].info["baseline"] == 0.75  # its first episode


def test_take_turns_alternates_the_roles_and_each_hears_the_others() -> None:
    from agentrl.env.roles import take_turns

    class Echo:
        def __init__(self, role: str) -> None:
            self.role, self.seen = role, []

        async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
            self.seen.append([dict(m) for m in body["messages"]])
            text = f"{self.role}{len(self.seen)}"
            return {"choices": [{"message": {"role": "assistant", "content": text}}]}

    a, b = Echo("a"), Echo("b")
    openings = {"a": [{"role": "user", "content": "start"}], "b": [{"role": "system", "content": "judge"}]}
    got = asyncio.run(take_turns({"a": a, "b": b}, ["a", "b"], openings, rounds=2, body={"max_tokens": 4}))
    assert got == [("a", "a1"), ("b", "b1"), ("a", "a2"), ("b", "b2")]
    # each conversation grows by its own replies (one sample per role) and hears the other's
    assert b.seen[0] == [{"role": "system", "content": "judge"}, {"role": "user", "content": "[a] a1"}]
    assert a.seen[1] == [{"role": "user", "content": "start"}, {"role": "assistant", "content": "a1"},
                         {"role": "user", "content": "[b] b1"}]
    assert b.seen[1][-2:] == [{"role": "assistant", "content": "b1"}, {"role": "user", "content": "[a] a2"}]
    with pytest.raises(ValueError, match="nothing to answer"):
        asyncio.run(take_turns({"a": Echo("a")}, ["a"], {"a": []}, rounds=1))


def test_the_relay_scores_each_role_on_its_own_part_and_the_team_on_the_sum() -> None:
    """environments/arithmetic_relay with a stand-in client that answers each agent's question at once
    (no tool call): the first agent right and the second wrong, then both right."""
    import re as re_

    from agentrl.rollout.episode import run_episode

    class Arithmetic(Answering):
        wrong_role = "second"

        async def chat(self, body: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
            out = await super().chat(body, session_id)
            expr = re_.search(r"What is (.+)\?", body["messages"][-1]["content"])[1]
            value = int(eval(expr)) + (1 if session_id and session_id.endswith(self.wrong_role) else 0)  # noqa: S307
            out["choices"][0]["message"]["content"] = f"The answer is {value}."
            return out

    relay = type(agentrl.make("arithmetic_relay"))

    class NoSandbox(relay):  # no tool call is made here: the stand-in answers at once
        sandbox_image = None

    agentrl.environment("test_relay")(NoSandbox)
    task = next(iter(NoSandbox().tasks("test")))
    cases = (("second", {"first": True, "second": False}), ("nobody", {"first": True, "second": True}))
    try:
        for wrong, wins in cases:
            client = Arithmetic()
            client.wrong_role = wrong
            ep = asyncio.run(run_episode(client, "test_relay", task, group_id="g", limits=EpisodeLimits()))
            assert ep.error is None and ep.terminated and ep.turns == 2
            assert ep.info["role_success"] == wins
            assert ep.info["role_rewards"] == {r: float(w) for r, w in wins.items()}
            assert ep.reward == float(all(wins.values())) and ep.info["success"] == all(wins.values())
    finally:
        agentrl.env.registry.unregister("test_relay")
