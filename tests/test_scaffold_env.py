"""A scaffold program gets a scrubbed environment: its endpoint and the task as the model sees it,
what a program needs to start, and nothing of serve's secrets or of the task record (the answer)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from agentrl.rollout.scaffold import CommandScaffold, ScaffoldContext

PRINT_ENV = [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]


def _ctx() -> ScaffoldContext:
    return ScaffoldContext(base_url="http://127.0.0.1:8000/sessions/abc/v1", api_key="sess-abc", model="m",
                           messages=[{"role": "user", "content": "What is 2 + 2?"}],
                           task={"id": "t0", "question": "What is 2 + 2?", "answer": 4})


def test_a_scaffold_program_sees_no_secret_and_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_ADMIN_TOKEN", "admin-secret")
    monkeypatch.setenv("AGENTRL_API_KEYS", "client-key-1,client-key-2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret")
    env = json.loads(asyncio.run(CommandScaffold(PRINT_ENV)(_ctx())))
    text = json.dumps(env)
    assert "admin-secret" not in text and "client-key-1" not in text and "cloud-secret" not in text
    assert "AGENTRL_TASK" not in env and '"answer"' not in text
    assert (
        env["OPENAI_BASE_URL"] == "http://127.0.0.1:8000/sessions/abc/v1"
        and env["OPENAI_API_KEY"] == "sess-abc"
    )
    assert env["AGENTRL_PROMPT"] == "What is 2 + 2?" and "PATH" in env


def test_scaffold_env_passes_the_named_variables_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_AGENT_SETTING", "on")
    monkeypatch.setenv("AGENTRL_ADMIN_TOKEN", "admin-secret")
    env = json.loads(asyncio.run(CommandScaffold(PRINT_ENV, passthrough=("MY_AGENT_SETTING",))(_ctx())))
    assert env["MY_AGENT_SETTING"] == "on" and "AGENTRL_ADMIN_TOKEN" not in env
