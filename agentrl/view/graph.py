"""A multi-agent episode's graph as the view reads it from the episode's line in ``episodes.jsonl``.

The rollout saves the graph as ``info.graph`` (:class:`agentrl.rollout.roles.EpisodeGraph`): one
node per call (its role, what sampled it, its router session and call index, versions, completion
tokens, whether it trains) and edges ``[parent, child, kind]`` (``turn``, ``fork``,
``compaction``), and the rewards the environment gave per role as ``info.role_rewards``. Here the
line is untrusted input: each field is checked and cut to a bound, and a line without a graph (a
single-agent episode) has none.

A role's reward is ``role_rewards[role]``, or the episode's reward for a role the environment left
out (as the rollout gives its samples).
"""

from __future__ import annotations

import math
from typing import Any

from agentrl.router.sessions import valid_session_id

MAX_NODES = 2_000  # nodes drawn per episode at most
EDGE_KINDS = ("turn", "fork", "compaction")


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _graph(line: dict[str, Any] | None) -> dict[str, Any] | None:
    info = line.get("info") if isinstance(line, dict) else None
    graph = info.get("graph") if isinstance(info, dict) else None
    return graph if isinstance(graph, dict) and isinstance(graph.get("nodes"), list) else None


def graph_view(line: dict[str, Any] | None) -> dict[str, Any] | None:
    """The graph of an episode line, checked: ``{"roles", "nodes", "edges", "role_rewards"}``, the
    roles in the order of their first call; None for an episode without one."""
    graph = _graph(line)
    if graph is None:
        return None
    nodes = []
    for n in graph["nodes"][:MAX_NODES]:
        if not isinstance(n, dict) or _int(n.get("id")) is None or not isinstance(n.get("role"), str):
            continue
        session = n.get("session")
        nodes.append({
            "id": n["id"], "role": n["role"][:64], "sampler": str(n.get("sampler") or "")[:200],
            "parent": _int(n.get("parent")), "edge": n.get("edge") if n.get("edge") in EDGE_KINDS else None,
            # a session the view can open, or None (an external endpoint's call is in none)
            "session": session if isinstance(session, str) and valid_session_id(session) else None,
            "call": _int(n.get("call")),
            "versions": [v for v in n.get("versions") or [] if _int(v) is not None][:64],
            "completion_tokens": _int(n.get("completion_tokens")) or 0,
            "trained": n.get("trained") is True,
        })
    ids = {n["id"] for n in nodes}
    edges = [[e[0], e[1], e[2]] for e in graph.get("edges") or []
             if isinstance(e, list) and len(e) == 3 and e[0] in ids and e[1] in ids and e[2] in EDGE_KINDS]
    roles = list(dict.fromkeys(n["role"] for n in nodes))
    return {"roles": roles, "nodes": nodes, "edges": edges, "role_rewards": role_rewards(line)}


def roles_and_samplers(line: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The roles that called in an episode and what sampled their calls (``policy:<name>``, with
    ``policy:`` the default policy, ``frozen``, ``endpoint:<url>``); empty for a single-agent one."""
    graph = _graph(line)
    if graph is None:
        return [], []
    roles: dict[str, None] = {}
    samplers: dict[str, None] = {}
    for n in graph["nodes"][:MAX_NODES]:
        if isinstance(n, dict) and isinstance(n.get("role"), str):
            roles[n["role"][:64]] = None
            samplers[str(n.get("sampler") or "")[:200]] = None
    return list(roles), list(samplers)


def role_rewards(line: dict[str, Any]) -> dict[str, float]:
    """Each role's reward in an episode: the environment's ``role_rewards``, else the episode's reward."""
    roles, _ = roles_and_samplers(line)
    info = line.get("info") if isinstance(line.get("info"), dict) else {}
    given = info.get("role_rewards") if isinstance(info.get("role_rewards"), dict) else {}
    reward = line.get("reward")
    out = {}
    for role in roles:
        r = given.get(role, reward)
        if isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r):
            out[role] = float(r)
    return out
