"""`agentrl envs list | show` helpers (`try`, agentrl.rollout.tryout, runs against real vLLM in
test_environments_vllm and test_env_cli_ecosystems)."""

from __future__ import annotations

import json

from agentrl.env.cli import list_envs, show_env


def test_list_shows_every_built_in_environment_with_its_summary() -> None:
    lines: list[str] = []
    assert list_envs(lines.append) == 0
    text = "".join(lines)
    for name in ("arithmetic", "coding", "shell", "guess_number"):
        assert name in text
    assert "Guess the number" in text


def test_show_prints_an_example_task_and_the_opening_with_tools() -> None:
    chunks: list[str] = []
    assert show_env("coding", chunks.append) == 0
    info = json.loads("".join(chunks))
    assert info["name"] == "coding" and info["sandbox_image"] == "agentrl/base:bookworm"
    assert info["example_task"]["id"] and [t["function"]["name"] for t in info["tools"]] == ["run_python"]
    chunks.clear()
    show_env("guess_number", chunks.append, high=10)
    info = json.loads("".join(chunks))
    assert "from 1 to 10" in info["messages"][-1]["content"] and info["tools"] == []


def test_show_takes_the_environments_config_and_a_missing_one_is_a_clear_error() -> None:
    import subprocess
    import sys

    def show(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agentrl.cli", "envs", "show", "mix", *args],
                              capture_output=True, text=True, timeout=120)

    ok = show("--config", '{"envs": {"guess_number": {"high": 8}, "straggler": {}}}')
    assert ok.returncode == 0, ok.stderr
    info = json.loads(ok.stdout)
    assert (
        info["example_task"]["mix_env"] == "guess_number" and "from 1 to 8" in info["messages"][-1]["content"]
    )
    bare = show()
    assert bare.returncode != 0 and "Traceback" not in bare.stderr
    assert 'agentrl envs: configuration error: env.config of "mix" names its environments' in bare.stderr
    bad = show("--config", "[1]")
    assert bad.returncode != 0 and "must be a JSON object" in bad.stderr and "Traceback" not in bad.stderr
