"""The rollout side of multi-agent episodes: each role's agents, bound as the config says, and the
episode graph of their calls.

A :class:`Cast` serves one episode of a :class:`~agentrl.env.roles.MultiAgentEnv`. A role bound to a
policy (the default one, a named LoRA policy, or the frozen base model) calls through its own router
session, ``<episode id>.<role>``: its calls stitch only with each other, and a call's ``model`` is the
binding's. A role bound to an external endpoint calls it directly (no session: nothing to train).
All of them spend the episode's one turn and token budget.

The graph: one :class:`Node` per call (role, what sampled it, the versions that did, its router
session and call index), joined to the call it follows by a ``turn``, ``fork`` (a sub-agent's first
call) or ``compaction`` (a new context replacing an old one) edge. It is saved with the episode
(``episodes.jsonl``), and each trained role's samples carry their role and the graph nodes of their
chain (``info["role"]``, ``info["calls"]``: node ids, unique in the episode).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from agentrl.engines.config import BASE_POLICY
from agentrl.errors import EnvironmentFailure, TransportError
from agentrl.rollout.calls import SessionModel, episode_samples
from agentrl.router.errors import RouterError

if TYPE_CHECKING:
    from agentrl.rollout.config import EpisodeLimits, RoleBinding
    from agentrl.rollout.episode import EpisodeResult
    from agentrl.rollout.protocols import ChatClient
    from agentrl.router.sessions import SessionSummary

log = logging.getLogger(__name__)

__all__ = ["Cast", "EpisodeGraph", "Node", "RoleBaselines", "add_role_samples", "router_model", "sampler_of",
           "session_graph"]

EDGES = ("turn", "fork", "compaction")


@dataclass
class Node:
    id: int
    role: str
    # "policy:<name>" ("policy:" the default; ":lag<k>" or ":v<N>" after it), "frozen" or "endpoint:<url>"
    sampler: str
    parent: int | None  # the call this one follows (None: the role's first context)
    edge: str | None  # "turn" | "fork" | "compaction" (None without a parent)
    session: str | None  # the router session that recorded it (None: an external endpoint's call)
    call: int | None  # its index in that session
    versions: list[int] = field(default_factory=list)  # the policy versions that sampled it, sorted
    completion_tokens: int = 0
    trained: bool = False


class RoleBaselines:
    """Running baselines of roles' rewards (``advantage: baseline``), shared by a producer's episodes:
    an exponential moving average per key, kept in serve's memory (a restarted serve starts again)."""

    def __init__(self, rate: float = 0.1) -> None:
        self.rate = rate
        self.values: dict[str, float] = {}

    def see(self, key: str, reward: float) -> float:
        """The baseline ``key``'s episode is compared with (the average before it; its own reward for
        the first), then moved toward ``reward``."""
        before = self.values.get(key, reward)
        self.values[key] = before + self.rate * (reward - before)
        return before


class EpisodeGraph:
    """The calls of one episode and how they follow each other (built as they complete)."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self._by_call: dict[tuple[str, int], int] = {}

    def add(self, **fields: Any) -> Node:
        node = Node(id=len(self.nodes), **fields)
        self.nodes.append(node)
        if node.session is not None and node.call is not None:
            self._by_call[(node.session, node.call)] = node.id
        return node

    def node_of(self, session: str, call: int) -> int | None:
        return self._by_call.get((session, call))

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": [asdict(n) for n in self.nodes],
                "edges": [[n.parent, n.id, n.edge] for n in self.nodes if n.parent is not None]}


def router_model(b: RoleBinding | None) -> str:
    """The router's ``model`` for what plays a router-bound role: a named policy, ``"base"`` (frozen),
    ``"<policy>:lag<k>"`` or ``"<policy>:v<N>"`` (``default`` for the default policy), or "" (the
    default policy)."""
    if b is None:
        return ""
    if b.frozen:
        return BASE_POLICY
    if b.lag:  # the router's name for the policy's adapter lag versions back
        return f"{b.policy or 'default'}:lag{b.lag}"
    if b.version:  # and for its published version N
        return f"{b.policy or 'default'}:v{b.version}"
    return b.policy


def sampler_of(b: RoleBinding | None) -> str:
    """What samples a role's calls, as the graph's nodes name it."""
    if b is not None and b.endpoint:
        return f"endpoint:{b.endpoint}"
    if b is not None and b.frozen:
        return "frozen"
    policy = f"policy:{b.policy if b is not None else ''}"
    if b is not None and b.version:
        return f"{policy}:v{b.version}"
    return f"{policy}:lag{b.lag}" if b is not None and b.lag else policy


def add_role_samples(ep: EpisodeResult, role: str, b: RoleBinding | None, summary: SessionSummary,
                     graph: EpisodeGraph, reward: float, baselines: RoleBaselines) -> None:
    """Add a trained role's session's samples to ``ep.samples``: its role, ``reward`` (or the team's,
    by the binding's advantage setting), the binding's advantage settings and the chain's graph nodes."""
    extra: dict[str, Any] = {}
    if b is not None and b.advantage == "team":
        reward, extra["advantage"] = ep.reward, "team"
    elif b is not None and b.advantage == "baseline":
        extra.update(advantage="baseline", baseline=baselines.see(f"{ep.env}/{role}", reward))
    if b is not None and b.loss_weight != 1.0:
        extra["loss_weight"] = b.loss_weight
    for s in episode_samples(summary, ep):
        nodes = [graph.node_of(summary.session_id, c) for c in s.info["calls"]]
        info = {**s.info, "role": role, "calls": nodes, **extra}
        ep.samples.append(replace(s, reward=reward, info=info))


def session_graph(summaries: Mapping[str, SessionSummary],
                  bindings: Mapping[str, RoleBinding]) -> EpisodeGraph:
    """The graph of role sessions' recorded calls (an external program's: no fork or compaction is
    seen from outside), in the order they completed: each call's parent is the call it continued
    within its role's session (a ``turn``), none where it started a new context."""
    graph = EpisodeGraph()
    calls = sorted(((c.created, role, summary.session_id, c) for role, summary in summaries.items()
                    for c in summary.call_log), key=lambda x: (x[0], x[2], x[3].index))
    for _, role, sid, c in calls:
        parent = graph.node_of(sid, c.parent) if c.parent is not None else None
        b = bindings.get(role)
        graph.add(role=role, sampler=sampler_of(b), parent=parent,
                  edge="turn" if parent is not None else None, session=sid, call=c.index,
                  versions=c.versions, completion_tokens=c.completion_tokens, trained=b is None or b.trained)
    return graph


class RoleAgent:
    """One agent of a role (:class:`agentrl.env.roles.Agent`)."""

    def __init__(self, cast: Cast, role: str, parent: int | None = None, edge: str | None = None) -> None:
        self.cast, self.role, self.trained = cast, role, cast.trained(role)
        self._last, self._edge = parent, edge
        model = cast.models[role]
        self.name, self.max_tokens, self.temperature = model.name, model.max_tokens, model.temperature

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        parent, edge = self._last, (self._edge or "turn") if self._last is not None else None
        out, node = await self.cast.call(self.role, body, parent, edge)
        self._last, self._edge = node.id, None
        return out

    def fork(self, role: str | None = None) -> RoleAgent:
        role = self.role if role is None else role
        if role not in self.cast.models:
            raise EnvironmentFailure(f"fork to role {role!r}, which the environment does not declare "
                                     f"(its roles: {list(self.cast.models)})")
        return RoleAgent(self.cast, role, self._last, "fork")

    def compact(self) -> None:
        self._edge = "compaction"


class Cast:
    """The agents of one multi-agent episode and what they spend; see the module's docstring.

    ``play_episode`` reads ``ep``, ``refused`` and ``model_failure`` as it does a single agent's
    :class:`~agentrl.rollout.episode.SessionModel`; :meth:`finish` closes the role sessions and adds the
    trained roles' samples to the episode."""

    def __init__(self, client: ChatClient, ep: EpisodeResult, limits: EpisodeLimits,
                 bindings: Mapping[str, RoleBinding], baselines: RoleBaselines | None = None) -> None:
        self.client, self.ep, self.limits, self.bindings = client, ep, limits, dict(bindings)
        self.baselines = baselines if baselines is not None else RoleBaselines()
        self.graph = EpisodeGraph()
        self.models: dict[str, SessionModel] = {}
        self.sessions: dict[str, str] = {}  # role -> its router session, once opened
        self.role_rewards: dict[str, float] = {}
        self._endpoints: list[Any] = []
        self._under_way: dict[asyncio.Task[Any] | None, int] = {}  # the tasks with an agent call under way
        self.closed = False  # play returned: an agent's call from now on is a stray branch's

    # -- what play_episode reads ---------------------------------------------------------------------
    @property
    def refused(self) -> str | None:
        return next((m.refused for m in self.models.values() if m.refused is not None), None)

    @property
    def model_failure(self) -> BaseException | None:
        return next((m.model_failure for m in self.models.values() if m.model_failure is not None), None)

    # -- agents ---------------------------------------------------------------------------------------
    async def open(self, roles: Iterable[str]) -> None:
        """Bind each of the environment's ``roles`` as the config says (an endpoint's client opened)."""
        from agentrl.rollout.remote import OpenAIChat

        roles = tuple(roles)
        unbound = sorted(set(self.bindings) - set(roles))
        if unbound:  # the builder checks this at start; an environment's roles may also vary by task
            raise EnvironmentFailure(f"env.roles binds {unbound}, which the environment does not declare "
                                     f"(its roles: {list(roles)})")
        for role in roles:
            b = self.bindings.get(role)
            if b is not None and b.endpoint:
                key = os.environ.get(b.api_key_env, "") if b.api_key_env else ""
                chat = OpenAIChat(b.endpoint, api_key=key, model=b.endpoint_model,
                                  timeout_s=self.limits.episode_timeout_s)
                self._endpoints.append(chat)
                await chat.__aenter__()  # names the endpoint's first model when the binding names none
                self.models[role] = SessionModel(chat, self.ep, self.limits, session_id=None)
            else:
                self.models[role] = SessionModel(self.client, self.ep, self.limits, router_model(b),
                                                 session_id=f"{self.ep.episode_id}.{role}")

    def agents(self, roles: Iterable[str]) -> dict[str, RoleAgent]:
        """One agent per role (the environment's ``roles``; :meth:`open` bound them)."""
        missing = [r for r in roles if r not in self.models]
        if missing:
            raise EnvironmentFailure(f"roles {missing} were not bound for this episode")
        return {role: RoleAgent(self, role) for role in roles}

    def sampler(self, role: str) -> str:
        return sampler_of(self.bindings.get(role))

    def trained(self, role: str) -> bool:
        b = self.bindings.get(role)
        return b is None or b.trained

    def calls_under_way(self) -> int:
        """Agent calls started and not finished (after ``play`` returned: branches never awaited)."""
        return sum(self._under_way.values())

    async def call(self, role: str, body: dict[str, Any], parent: int | None,
                   edge: str | None) -> tuple[dict[str, Any], Node]:
        if self.closed:
            raise EnvironmentFailure(f"role {role!r} called after its episode's play returned (a sub-agent "
                                     "that was never awaited)")
        task = asyncio.current_task()
        self._under_way[task] = self._under_way.get(task, 0) + 1
        try:
            return await self._call(role, body, parent, edge)
        finally:
            self._under_way[task] -= 1
            if not self._under_way[task]:
                del self._under_way[task]

    async def _call(self, role: str, body: dict[str, Any], parent: int | None,
                    edge: str | None) -> tuple[dict[str, Any], Node]:
        model = self.models[role]
        sid = model.session_id
        if sid is not None and role not in self.sessions:
            self.sessions[role] = sid
            await self.client.begin(sid, group_id=self.ep.group_id, env=self.ep.env)
        body = {k: v for k, v in body.items() if k != "model"}  # the binding picks the model
        out = await model.chat(body)
        meta = out.get("agentrl") or {}
        choice = out["choices"][0]
        versions = sorted(set(meta.get("versions", [[]])[0])) if meta else []
        node = self.graph.add(role=role, sampler=self.sampler(role), parent=parent, edge=edge,
                              session=meta.get("session_id"), call=meta.get("call_index"), versions=versions,
                              completion_tokens=len(choice.get("token_ids") or []) or int(
                                  (out.get("usage") or {}).get("completion_tokens") or 0),
                              trained=self.trained(role) and bool(meta))
        return out, node

    # -- the end ----------------------------------------------------------------------------------
    async def finish(self) -> None:
        """Close every role session the episode opened and add the trained roles' samples to
        ``ep.samples`` (with their role, reward and graph nodes); save the graph on the episode."""
        ep = self.ep
        self.closed = True
        me = asyncio.current_task()
        strays = [t for t in self._under_way if t is not None and t is not me and not t.done()]
        for t in strays:  # a branch play never awaited: its call ends with the episode
            t.cancel()
        if strays:
            await asyncio.wait(strays, timeout=10.0)
        for chat in self._endpoints:
            try:
                await chat.__aexit__(None, None, None)
            except Exception:
                log.debug("closing a role's endpoint client failed", exc_info=True)
        for role, sid in self.sessions.items():
            try:
                summary = await asyncio.shield(self.client.end(sid))
            except (TransportError, RouterError) as e:  # the role's records are lost with serve's answer
                log.warning("could not close session %s: %s", sid, e)
                if ep.error is None:
                    ep.fail("transport", f"TransportError: could not close role {role}'s session: {e}")
                continue
            if summary is None or not self.trained(role):
                continue
            add_role_samples(ep, role, self.bindings.get(role), summary, self.graph,
                             self.role_rewards.get(role, ep.reward), self.baselines)
        ep.info["graph"] = self.graph.to_dict()
        if self.role_rewards:
            ep.info["role_rewards"] = dict(self.role_rewards)
