"""The web view of multi-agent episodes, through its aiohttp app on a recorded run directory: an
episode's graph (roles, calls, fork and compaction edges) comes from its line in ``episodes.jsonl``,
each node's call opens from its role's session (``sessions/<episode>.<role>.jsonl``) with the router's
own stitching, the browser filters by role and by policy, and the run's series carry each role's reward.

The run is shaped like ``tests/test_multi_agent_vllm.py``'s: a lead agent on policy ``lead`` plans,
forks three helper sub-agents (policy ``helper``), compacts and finishes; a frozen judge grades on
the base weights and a critic answers from an external endpoint (no session)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from agentrl.router.sessions import CallRecord, Completion, Session
from agentrl.view.graph import graph_view, role_rewards
from agentrl.view.logs import EpisodeFilter, EpisodeIndex
from tests.test_view import TOKEN, run_app, write_view_run

AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENDPOINT = "http://127.0.0.1:9/v1"


def _call(sid: str, index: int, prompt: list[int], completion: list[int], version: int, text: str,
          messages: list[dict[str, Any]], parent: int | None = None) -> CallRecord:
    c = Completion(completion, [-0.25] * len(completion), [version] * len(completion), "stop",
                   {"role": "assistant", "content": text})
    policy = sid.rsplit(".", 1)[1].replace("judge", "base")  # as the router records it
    return CallRecord(sid, index, parent, 0, prompt, [c], "engine-0", created=1_760_000_000.0 + index,
                      latency_s=0.1, messages=messages, policy=policy)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


Records = dict[str, list[CallRecord]]


def multi_agent_episode(eid: str, version: int, t: float,
                        lead_reward: float = 1.0) -> tuple[dict[str, Any], Records]:
    """One episode's line and its role sessions' records: lead 0 -> helpers 1, 2, 3 (forks), lead 4
    (a compaction), the frozen judge 5, the endpoint critic 6, the judge's next turn 7 (continuing 5
    token for token: one sample of two calls)."""
    v = version
    lead = [_call(f"{eid}.lead", 0, [1, 10, 11, 2], [20, 21, 22, 2], v, "plan", _user("Plan a note.")),
            _call(f"{eid}.lead", 1, [1, 12, 13, 2], [23, 24, 2], v + 1, "note", _user("Summary. Finish."))]
    helper = [_call(f"{eid}.helper", i, [1, 30 + i, 2], [40 + i, 41, 2], v, f"part {i}", _user(f"Part {i}."))
              for i in range(3)]
    judge = [_call(f"{eid}.judge", 0, [1, 50, 2], [60, 2], 0, "7/10", _user("Grade: ...")),
             _call(f"{eid}.judge", 1, [1, 50, 2, 60, 2, 1, 51, 2], [61, 2], 0, "8/10",
                   _user("Grade: ...") + [{"role": "assistant", "content": "7/10"}] + _user("Again."),
                   parent=0)]

    def node(i: int, role: str, sampler: str, parent: int | None, edge: str | None, session: str | None,
             call: int | None, versions: list[int], tokens: int, trained: bool) -> dict[str, Any]:
        return {"id": i, "role": role, "sampler": sampler, "parent": parent, "edge": edge, "session": session,
                "call": call, "versions": versions, "completion_tokens": tokens, "trained": trained}

    nodes = [node(0, "lead", "policy:lead", None, None, f"{eid}.lead", 0, [v], 4, True)]
    nodes += [node(1 + i, "helper", "policy:helper", 0, "fork", f"{eid}.helper", i, [v], 3, True)
              for i in range(3)]
    nodes += [node(4, "lead", "policy:lead", 0, "compaction", f"{eid}.lead", 1, [v + 1], 3, True),
              node(5, "judge", "frozen", None, None, f"{eid}.judge", 0, [0], 2, False),
              node(6, "critic", f"endpoint:{ENDPOINT}", None, None, None, None, [], 10, False),
              node(7, "judge", "frozen", 5, "turn", f"{eid}.judge", 1, [0], 2, False)]
    edges = [[n["parent"], n["id"], n["edge"]] for n in nodes if n["parent"] is not None]
    line = {"time": t, "episode_id": eid, "group_id": "g", "env": "lead_and_helpers", "task_id": "t0",
            "reward": 1.0, "turns": 8, "terminated": True, "truncated": False, "error": None,
            "error_kind": None, "versions": [v, v + 1], "completion_tokens": 25, "seconds": 1.5,
            "num_samples": 5,
            "info": {"graph": {"nodes": nodes, "edges": edges},
                     "role_rewards": {"lead": lead_reward, "helper": 0.5}}}
    return line, {"lead": lead, "helper": helper, "judge": judge}


def write_multi_agent_run(run_dir: Path, episodes: int = 4) -> dict[str, Records]:
    """The recorded single-agent run of ``tests/test_view.py`` plus ``episodes`` multi-agent episodes
    ``m0`` ... (lead rewards 0, 1, 0, 1, ...), their lines appended to ``episodes.jsonl`` and their
    role sessions in ``sessions/``; returns each episode's records by role."""
    write_view_run(run_dir)
    out = {}
    with open(run_dir / "episodes.jsonl", "a") as f:
        for k in range(episodes):
            eid = f"m{k}"
            line, records = multi_agent_episode(eid, version=2 + k, t=1_760_000_900.0 + k,
                                                lead_reward=float(k % 2))
            f.write(json.dumps(line) + "\n")
            for role, recs in records.items():
                path = run_dir / "sessions" / f"{eid}.{role}.jsonl"
                path.write_text("".join(r.to_json() + "\n" for r in recs))
            out[eid] = records
    return out


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENTRL_VIEW_TOKEN", TOKEN)
    monkeypatch.delenv("AGENTRL_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("AGENTRL_ADMIN_TOKEN_FILE", raising=False)
    d = tmp_path / "run"
    write_multi_agent_run(d)
    return d


def test_a_multi_agent_episode_answers_its_graph_and_which_role_sessions_are_recorded(run_dir: Path) -> None:
    async def body(c: TestClient) -> None:
        r = await c.get("/view/api/episode/m1", headers=AUTH)
        assert r.status == 200
        ep = await r.json()
        assert ep["episode"]["episode_id"] == "m1" and ep["calls"] == [] and ep["samples"] == []
        g = ep["graph"]
        assert g["roles"] == ["lead", "helper", "judge", "critic"]  # in the order of their first calls
        assert [n["id"] for n in g["nodes"]] == list(range(8))
        assert sorted(map(tuple, g["edges"])) == [(0, 1, "fork"), (0, 2, "fork"), (0, 3, "fork"),
                                                   (0, 4, "compaction"), (5, 7, "turn")]
        assert g["sessions"] == {"m1.helper": True, "m1.judge": True, "m1.lead": True}
        assert g["nodes"][6]["session"] is None and g["nodes"][6]["sampler"] == f"endpoint:{ENDPOINT}"
        assert g["role_rewards"] == {"lead": 1.0, "helper": 0.5, "judge": 1.0, "critic": 1.0}
        # a single-agent episode has no graph
        assert (await (await c.get("/view/api/episode/e1", headers=AUTH)).json())["graph"] is None
        assert (await c.get("/view/api/episode/nothing-here", headers=AUTH)).status == 404

    run_app(run_dir, body)


def test_a_nodes_call_opens_from_its_role_session_with_the_routers_stitching(run_dir: Path) -> None:
    done: list[bool] = []
    lines = (run_dir / "sessions" / "m1.lead.jsonl").read_text().splitlines()
    lead = [CallRecord.from_dict(json.loads(x)) for x in lines]
    truth = Session("m1.lead", records=lead).samples()
    assert len(truth) == 2  # the compaction started a new context: two samples

    async def body(c: TestClient) -> None:
        ep = await (await c.get("/view/api/episode/m1", headers=AUTH)).json()
        node = ep["graph"]["nodes"][4]  # the lead's call after the compaction
        sess = await (await c.get(f"/view/api/episode/{node['session']}", headers=AUTH)).json()
        (sample,) = [s for s in sess["samples"] if node["call"] in s["calls"]]
        assert sample["versions"] == [4] and sample["trained"] == 3  # m1: version 3, then 4
        page = await (await c.get(f"/view/api/episode/{node['session']}/sample/{sample['index']}",
                                  headers=AUTH)).json()
        s = truth[sample["index"]]
        assert page["ids"] == s.token_ids.tolist() == [1, 12, 13, 2, 23, 24, 2]
        assert page["mask"] == s.loss_mask.tolist() and page["version"] == s.versions.tolist()
        assert page["spans"] == [{"call": 1, "start": 4, "end": 7}]
        # the helpers' session: three sub-agents, three samples of one call each
        helpers = await (await c.get("/view/api/episode/m1.helper", headers=AUTH)).json()
        assert [s["calls"] for s in helpers["samples"]] == [[0], [1], [2]]
        assert helpers["calls"][2]["new_messages"] == [{"role": "user", "content": "Part 2."}]
        # the frozen judge's two turns stitch into one sample, as any multi-turn agent's
        judge = await (await c.get("/view/api/episode/m1.judge", headers=AUTH)).json()
        assert [s["calls"] for s in judge["samples"]] == [[0, 1]]
        # a session id names a file inside sessions/ only
        for bad in ("m1..lead", "..%2Fm1.lead", ".m1", "m1.lead%2F..%2F..%2Fsecret"):
            assert (await c.get(f"/view/api/episode/{bad}", headers=AUTH)).status == 404, bad
        done.append(True)

    run_app(run_dir, body)
    assert done == [True]


def test_the_episode_browser_filters_by_role_and_by_policy(run_dir: Path) -> None:
    index = EpisodeIndex(run_dir / "episodes.jsonl")
    index.refresh()
    facets = index.facets()
    assert facets["roles"] == ["critic", "helper", "judge", "lead"]
    assert facets["policies"] == ["endpoint:" + ENDPOINT, "frozen", "policy:helper", "policy:lead"]
    everything = index.match(EpisodeFilter(), 0, 1000)[0]
    assert everything == len(index) > 4
    assert index.match(EpisodeFilter(role="helper"), 0, 100)[0] == 4
    assert index.match(EpisodeFilter(policy="frozen"), 0, 100)[0] == 4
    assert index.match(EpisodeFilter(role="lead", policy="policy:lead", version_min=4), 0, 100)[0] == 3
    assert index.match(EpisodeFilter(role="nobody"), 0, 100) == (0, [])
    assert index.match(EpisodeFilter(policy="policy:"), 0, 100) == (0, [])

    async def body(c: TestClient) -> None:
        got = await (await c.get("/view/api/episodes?role=lead&policy=policy%3Alead", headers=AUTH)).json()
        assert got["total"] == 4 and [r["episode_id"] for r in got["rows"]] == ["m3", "m2", "m1", "m0"]
        assert got["rows"][0]["roles"] == ["lead", "helper", "judge", "critic"]
        assert got["facets"]["roles"] == facets["roles"]
        single = await (await c.get("/view/api/episodes?limit=200", headers=AUTH)).json()
        assert all(r["roles"] == [] for r in single["rows"] if not r["episode_id"].startswith("m"))

    run_app(run_dir, body)


def test_the_run_series_carry_each_roles_reward_from_its_episodes(run_dir: Path) -> None:
    async def body(c: TestClient) -> None:
        got = await (await c.get("/view/api/series", headers=AUTH)).json()
        cols = got["episodes"]["cols"]
        assert sorted(k for k in cols if k.startswith("role_reward.")) == [
            "role_reward.critic", "role_reward.helper", "role_reward.judge", "role_reward.lead"]
        lead = cols["role_reward.lead"]
        # the single-agent episodes come first and have no roles; then lead rewards 0, 1, 0, 1
        assert [x for x in lead if x is not None] == [0.0, 1.0, 0.0, 1.0]
        assert lead[: len(lead) - 4] == [None] * (len(lead) - 4)
        assert [x for x in cols["role_reward.helper"] if x is not None] == [0.5] * 4
        # a role the environment gave no reward gets the episode's (the team reward)
        assert [x for x in cols["role_reward.judge"] if x is not None] == [1.0] * 4

    run_app(run_dir, body)


def test_role_rewards_bin_to_the_mean_of_the_episodes_a_role_played(tmp_path: Path) -> None:
    path = tmp_path / "episodes.jsonl"
    lines = [multi_agent_episode(f"m{k}", 1, float(k), lead_reward=float(k))[0] for k in range(4)]
    lines.insert(1, {"time": 9.0, "episode_id": "single", "env": "x", "reward": 0.0})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    index = EpisodeIndex(path)
    index.refresh()
    got = index.series(max_points=2)  # bins of 3 episodes: m0 single m1 | m2 m3
    assert got["cols"]["role_reward.lead"] == [0.5, 2.5]


def test_a_graph_line_is_checked_before_the_view_draws_it() -> None:
    line, _ = multi_agent_episode("m9", 1, 0.0)
    graph = line["info"]["graph"]
    graph["nodes"].append({"id": "7", "role": "x"})  # not a node: no integer id
    graph["nodes"][1]["session"] = "../../secret"  # not a session the view may open
    graph["edges"].append([0, 99, "fork"])  # to no node
    graph["edges"].append([0, 5, "teleport"])  # no such kind
    got = graph_view(line)
    assert got is not None and len(got["nodes"]) == 8 and len(got["edges"]) == 5
    assert got["nodes"][1]["session"] is None
    assert graph_view({"episode_id": "e", "info": {}}) is None and graph_view(None) is None
    assert role_rewards({"reward": 1.0, "info": {}}) == {}
