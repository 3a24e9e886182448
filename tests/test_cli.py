"""The ``agentrl`` command explains itself, round-trips its config, rejects bad settings, and
``agentrl status`` reads a running serve's ``/admin/status``."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from agentrl import config as C
from agentrl.cli import main, parser
from agentrl.web import start_on_loopback
from tests.conftest import after_help

ROOT = Path(__file__).resolve().parents[1]


def agentrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    full_env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=full_env)


def subcommand_paths(p: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path in the parser tree: ("serve",), ("config", "show"), ..."""
    paths = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths.append((*prefix, name))
                paths += subcommand_paths(sub, (*prefix, name))
    return paths


COMMANDS = subcommand_paths(parser())


def test_agentrl_help_lists_every_command() -> None:
    out = agentrl("--help")
    assert out.returncode == 0, out.stderr
    for name in ("serve", "learn", "run", "config", "model", "sandbox", "envs", "status", "eval", "plot"):
        assert name in out.stdout


def test_agentrl_help_imports_nothing_heavy() -> None:
    # the cheap stand-in for "answers in well under a second": no torch, vLLM, matplotlib, transformers
    out = after_help("heavy = [m for m in ('torch', 'vllm', 'matplotlib', 'transformers', 'ray', 'aiohttp') "
                     "if m in sys.modules]\nprint('HEAVY', heavy)")
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_subcommand_has_working_help(command: tuple[str, ...]) -> None:
    out = agentrl(*command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: agentrl " + " ".join(command))


@pytest.mark.parametrize("name", ["run", "serve", "learn"])
def test_config_show_prints_toml_that_parses_back_to_the_same_config(name: str, tmp_path: Path) -> None:
    cls = {"run": C.RunConfig, "serve": C.ServeConfig, "learn": C.LearnConfig}[name]
    out = agentrl("config", "show", name)
    assert out.returncode == 0, out.stderr
    assert C.build(cls, tomllib.loads(out.stdout)) == C.load(cls)
    # and as a file handed back to --config
    path = tmp_path / f"{name}.toml"
    path.write_text(out.stdout)
    assert C.load(cls, path) == C.load(cls)


def test_run_defaults_are_the_quickstart_recipe_and_an_override_keeps_the_rest() -> None:
    run, serve = C.load(C.RunConfig), C.load(C.ServeConfig)
    assert (run.serve.model, run.serve.env.group_size, run.serve.buffer.batch_size) == ("tiny-agent", 4, 32)
    assert (run.learn.lr, run.learn.steps) == (1e-4, 60)
    assert serve.model == "tiny-tools" and serve.env.group_size == 4  # serve's own defaults are untouched
    over = C.load(C.RunConfig, overrides=["--serve.model=tiny-tools", "--serve.env.max_turns=3"])
    assert (over.serve.model, over.serve.env.max_turns, over.serve.env.group_size) == ("tiny-tools", 3, 4)
    assert over.serve.buffer.batch_size == 32 and over.learn.steps == 60


def test_config_show_applies_file_and_overrides() -> None:
    out = agentrl("config", "show", "run", "--config", "examples/quickstart.toml", "--serve.env.group_size=8",
                  "--learn.lr=3e-5")
    assert out.returncode == 0, out.stderr
    data = tomllib.loads(out.stdout)
    assert data["serve"]["env"]["group_size"] == 8
    assert data["learn"]["lr"] == 3e-5
    assert data["serve"]["run_dir"] == "runs/quickstart"


def test_an_unknown_override_exits_non_zero_naming_the_key() -> None:
    out = agentrl("config", "show", "run", "--serve.engine.cuont=2")
    assert out.returncode != 0
    assert "serve.engine.cuont" in out.stderr
    assert "serve.engine.count" in out.stderr  # the message lists what is known there


def test_a_badly_typed_override_exits_non_zero_naming_the_key() -> None:
    out = agentrl("config", "show", "serve", "--router.port=eighty")
    assert out.returncode != 0
    assert "router.port" in out.stderr and "int" in out.stderr


def test_an_argument_that_is_not_a_setting_is_rejected() -> None:
    out = agentrl("config", "show", "run", "stray")
    assert out.returncode != 0
    assert "--section.key=value" in out.stderr


def test_plot_and_status_take_no_config_settings() -> None:
    for args in (("plot", "runs/nowhere", "--serve.env.name=shell"), ("status", "--serve.env.name=shell")):
        out = agentrl(*args)
        assert out.returncode != 0
        assert "takes no --section.key=value settings" in out.stderr


# -- agentrl status ---------------------------------------------------------------------------------

TOKEN = "s3cret-admin-token"

STATUS = {
    "uptime_s": 3725.0, "version": 12,
    "engines": [
        {"url": "http://10.0.0.5:8100", "name": "engine-0", "healthy": True, "outstanding": 14, "version": 12,
         "served": 48211, "failures": 0, "last_error": None},
        {"url": "http://10.0.0.6:8100", "name": "engine-1", "healthy": False, "outstanding": 0, "version": 11,
         "served": 40112, "failures": 3, "last_error": "ConnectionResetError: engine went away"},
    ],
    "router": {"calls": 88323, "errors_4xx": 2, "errors_5xx": 3, "prompt_tokens": 3.1e8,
               "completion_tokens": 1241000.0, "continued": 0, "splits": 4, "retries": 3},
    "rollout": {"in_flight": 96, "episodes": 22350.0, "failed": 41.0, "truncated": 310.0, "samples": 22350.0,
                "reward_sum": 9834.0, "tool_calls": 51200.0},
    "buffer": {"depth": 48, "produced": 22350, "consumed": 22112, "dropped": 190, "pending": 48, "leased": 16,
               "leased_batches": 1, "pollers": 1, "learner_version": 12, "identity_holds": True},
    "sandbox": {"backend": "docker", "warm": 4, "in_use": 88, "creating": 2, "created": 912, "destroyed": 820,
                "exec_count": 51200, "timeouts": 7, "oom_kills": 1, "infra_errors": 0, "exec_p50_ms": 71.3,
                "exec_p99_ms": 402.9, "acquire_p50_ms": 0.4, "acquire_p99_ms": 30.2},
}


@pytest.fixture
def fake_serve() -> Iterator[str]:
    """A small aiohttp server answering /admin/status like serve does (401 without the token)."""
    seen: list[str] = []

    async def status(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": {"message": "this route needs the admin token"}}, status=401)
        return web.json_response(STATUS)

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/admin/status", status)
    runner, url = loop.run_until_complete(start_on_loopback(app, access_log=None))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_status_prints_engines_versions_episodes_buffer_sandbox_and_throughput(
    fake_serve: str, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    out = agentrl("status", "--serve", fake_serve, "--admin-token-file", str(token_file))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "policy version 12" in text and "up 1h02m" in text
    assert "engines: 1/2 healthy" in text
    engine_rows = [line for line in text.splitlines() if "engine-" in line]
    assert len(engine_rows) == 2
    assert (
        "12" in engine_rows[0].split() and "11" in engine_rows[1].split() and "NO" in engine_rows[1].split()
    )
    assert "in flight 96" in text
    assert "depth 48" in text and "learner version 12" in text
    assert "docker" in text and "in use 88" in text and "exec p50 71.3 ms" in text
    assert "333 generated tokens/s" in text  # 1,241,000 tokens / 3725 s
    assert "episodes/min" in text


def test_status_reads_the_token_from_the_environment(fake_serve: str) -> None:
    out = agentrl(
        "status", "--serve", fake_serve, "--run-dir", "/nonexistent", env={"AGENTRL_ADMIN_TOKEN": TOKEN}
    )
    assert out.returncode == 0, out.stderr
    assert "policy version 12" in out.stdout


def test_status_reads_the_token_from_the_run_directory(fake_serve: str, tmp_path: Path) -> None:
    (tmp_path / "admin_token").write_text(TOKEN)
    out = agentrl("status", "--serve", fake_serve, "--run-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == STATUS


def test_status_with_a_wrong_token_says_the_token_was_refused(fake_serve: str, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("wrong")
    out = agentrl("status", "--serve", fake_serve, "--admin-token-file", str(token_file))
    assert out.returncode != 0
    assert "refused the admin token" in out.stderr


def test_status_without_a_token_says_where_to_put_one(tmp_path: Path) -> None:
    out = agentrl("status", "--serve", "http://127.0.0.1:9", "--run-dir", str(tmp_path))
    assert out.returncode != 0
    assert "--admin-token-file" in out.stderr and "AGENTRL_ADMIN_TOKEN" in out.stderr


def test_status_of_an_unreachable_serve_fails_with_a_message(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "admin_token").write_text(TOKEN)
    out = agentrl("status", "--serve", f"http://127.0.0.1:{port}", "--run-dir", str(tmp_path),
                  "--timeout", "5")
    assert out.returncode != 0
    assert "cannot reach serve" in out.stderr


def test_status_takes_no_token_value_on_the_command_line() -> None:
    with pytest.raises(SystemExit):
        main(["status", "--admin-token", TOKEN])


def test_status_rates_between_two_snapshots_use_the_interval() -> None:
    from agentrl.cli.status import rates

    later = json.loads(json.dumps(STATUS))
    later["uptime_s"] += 10
    later["router"]["completion_tokens"] += 5000
    later["rollout"]["episodes"] += 20
    r = rates(later, STATUS)
    assert r["tokens_per_s"] == pytest.approx(500.0)
    assert r["episodes_per_min"] == pytest.approx(120.0)
