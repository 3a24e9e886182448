"""The roles of an external multi-agent program: one base URL per role.

With ``env.roles`` and an external scaffold, the program's agents are the roles (the config names
them; the environment only sets the task and scores the answer). Each role bound to the router gets
its own session, ``<episode id>.<role>``, as the built-in :class:`~agentrl.rollout.roles.Cast` gives
it, whose ``policy`` (the session's meta) is what its calls sample when their ``model`` names no
policy: the binding's named policy, ``"base"`` (frozen) or ``"<policy>:lag<k>"``. A call whose
``model`` names a policy still samples that one. A role bound to an endpoint gets the endpoint's
URL (and the key its binding names): its calls are neither recorded nor graphed.

The episode's graph is built from the sessions' call records when they close (one node per call, in
the order the calls completed, each joined by a ``turn`` edge to the call it continued within its
role's session: a fork or a compaction is not visible from outside the program). Each trained role's
samples carry its role, its session's policy and the team reward (the environment scores the
program's one answer). Invariants: the role sessions share the episode's limits (one budget for all
of them, kept by the router); every session opened is closed, whatever happened.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentrl.errors import TransportError
from agentrl.rollout.roles import RoleBaselines, add_role_samples, router_model, session_graph
from agentrl.router.errors import RouterError
from agentrl.router.sessions import SessionSummary

if TYPE_CHECKING:
    from agentrl.rollout.config import RoleBinding
    from agentrl.rollout.episode import EpisodeResult
    from agentrl.rollout.protocols import ChatClient
    from agentrl.router.session_store import SessionLimits

log = logging.getLogger(__name__)

__all__ = ["RoleEndpoint", "ScaffoldRoles"]


@dataclass
class RoleEndpoint:
    """Where one role's agent sends its calls: an OpenAI client's base URL, key and model."""

    base_url: str
    api_key: str
    model: str


class ScaffoldRoles:
    """The role sessions of one episode played by an external program (see the module docstring)."""

    def __init__(self, client: ChatClient, ep: EpisodeResult, bindings: Mapping[str, RoleBinding],
                 limits: SessionLimits, baselines: RoleBaselines | None = None) -> None:
        self.client, self.ep, self.bindings, self.limits = client, ep, dict(bindings), limits
        self.baselines = baselines if baselines is not None else RoleBaselines()
        self.sessions: dict[str, str] = {}  # role -> its router session, once opened
        self.summaries: dict[str, SessionSummary] = {}  # role -> its closed session's summary

    async def open(self, router_url: str) -> dict[str, RoleEndpoint]:
        """Open each router-bound role's session (``router_url``: the router as the program reaches it)
        and say where each role calls."""
        out: dict[str, RoleEndpoint] = {}
        for role, b in self.bindings.items():
            if b.endpoint:
                key = os.environ.get(b.api_key_env, "") if b.api_key_env else ""
                out[role] = RoleEndpoint(b.endpoint.rstrip("/"), key or "none", b.endpoint_model)
                continue
            sid = f"{self.ep.episode_id}.{role}"
            policy = router_model(b)
            meta = {"policy": policy} if policy else {}
            await self.client.begin(sid, limits=self.limits, group_id=self.ep.group_id, env=self.ep.env,
                                    scaffold=self.ep.info.get("scaffold", ""), role=role, **meta)
            self.sessions[role] = sid
            out[role] = RoleEndpoint(f"{router_url.rstrip('/')}/sessions/{sid}/v1", f"sess-{sid}",
                                     self.client.model_name)
        return out

    async def end(self) -> SessionSummary | None:
        """Close the role sessions: what they spent together, as one session's summary (no samples;
        :meth:`finish` adds them). None when no session could be closed."""
        for role, sid in self.sessions.items():
            if role in self.summaries:
                continue
            try:
                summary = await asyncio.shield(self.client.end(sid))
            except (TransportError, RouterError) as e:  # the role's records are lost with serve's answer
                log.warning("could not close session %s: %s", sid, e)
                if self.ep.error is None:
                    self.ep.fail("transport", f"TransportError: could not close role {role}'s session: {e}")
                continue
            if summary is not None:
                self.summaries[role] = summary
        done = list(self.summaries.values())
        if not done:
            return None
        last = max(done, key=lambda s: max((c.created for c in s.call_log), default=0.0))
        return SessionSummary(
            self.ep.episode_id, [], splits=sum(s.splits for s in done), calls=sum(s.calls for s in done),
            completion_tokens=sum(s.completion_tokens for s in done),
            versions=sorted({v for s in done for v in s.versions}), last_reply=last.last_reply,
            refused=next((s.refused for s in done if s.refused), None),
            model_failures=sum(s.model_failures for s in done))

    async def finish(self) -> None:
        """Close what is still open, then save the graph on the episode and add the trained roles'
        samples (with the episode's reward: the program's answer is scored once)."""
        await self.end()
        graph = session_graph(self.summaries, self.bindings)
        for role, summary in self.summaries.items():
            b = self.bindings.get(role)
            if b is None or b.trained:
                add_role_samples(self.ep, role, b, summary, graph, self.ep.reward, self.baselines)
        self.ep.info["graph"] = graph.to_dict()
