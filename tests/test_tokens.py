"""Secrets come from files and environment variables, never from a command line."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from agentrl import config as C
from agentrl.cli.run import serve_command
from agentrl.credentials import find_admin_token, find_api_keys, settle_admin_token

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cret-token-value"


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "AGENTRL_ADMIN_TOKEN",
        "AGENTRL_ADMIN_TOKEN_FILE",
        "AGENTRL_API_KEYS",
        "AGENTRL_API_KEYS_FILE",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("setting", ["--admin_token", "--serve.admin_token", "--learn.admin_token",
                                     "--router.api_keys", "--serve.router.api_keys"])
def test_a_secret_given_as_a_command_line_setting_is_refused_with_the_way_to_give_it(setting: str) -> None:
    cls = C.RunConfig if setting.startswith(("--serve.", "--learn.")) else (
        C.ServeConfig if "router" in setting else C.LearnConfig)
    with pytest.raises(C.ConfigError) as e:
        C.load(cls, None, [f"{setting}={SECRET}"])
    msg = str(e.value)
    assert setting in msg and "command line" in msg and "_file" in msg and "$AGENTRL_" in msg
    assert SECRET not in msg


def test_the_cli_refuses_a_token_value_and_names_the_file_setting() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRL_")}
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "config", "show", "serve", f"--admin_token={SECRET}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode != 0
    assert "--admin_token_file=FILE" in out.stderr and "AGENTRL_ADMIN_TOKEN" in out.stderr


def test_admin_token_comes_from_file_setting_then_env_then_env_file_then_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "tok"
    f.write_text("from-file\n")
    f.chmod(0o600)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "admin_token").write_text("from-run-dir")
    assert find_admin_token("", "", tmp_path / "run") == "from-run-dir"
    env_file = tmp_path / "envtok"
    env_file.write_text("from-env-file")
    monkeypatch.setenv("AGENTRL_ADMIN_TOKEN_FILE", str(env_file))
    assert find_admin_token("", "", tmp_path / "run") == "from-env-file"
    monkeypatch.setenv("AGENTRL_ADMIN_TOKEN", "from-env")
    assert find_admin_token("", "", tmp_path / "run") == "from-env"
    assert find_admin_token("", str(f), tmp_path / "run") == "from-file"
    assert find_admin_token("from-config-file", str(f), tmp_path / "run") == "from-config-file"


def test_serve_generates_a_token_once_and_keeps_it_in_a_private_file(tmp_path: Path) -> None:
    token = settle_admin_token("", "", tmp_path)
    path = tmp_path / "admin_token"
    assert path.read_text() == token and len(token) >= 24
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert settle_admin_token("", "", tmp_path) == token


def test_api_keys_come_from_a_file_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "keys"
    f.write_text("# client keys\nkey-a\n\nkey-b\n")
    monkeypatch.setenv("AGENTRL_API_KEYS", "key-c, key-a")
    assert find_api_keys([], str(f)) == ["key-a", "key-b", "key-c"]


def test_agentrl_run_gives_its_serve_child_the_token_by_a_private_file_never_argv(tmp_path: Path) -> None:
    cfg = C.load(C.RunConfig, None, [f"--serve.run_dir={tmp_path}"])
    cfg.serve.admin_token = SECRET  # as from a config file
    token = settle_admin_token(cfg.serve.admin_token, cfg.serve.admin_token_file, tmp_path)
    cmd = serve_command(cfg.serve, tmp_path)
    assert token == SECRET
    assert not any(SECRET in arg for arg in cmd)
    toml = (tmp_path / "serve.toml").read_text()
    assert SECRET not in toml
    assert stat.S_IMODE((tmp_path / "serve.toml").stat().st_mode) == 0o600
    child_cfg = C.load(C.ServeConfig, tmp_path / "serve.toml")
    assert find_admin_token(child_cfg.admin_token, child_cfg.admin_token_file, None) == SECRET
    assert tomllib.loads(toml)["admin_token"] == ""


def test_the_serve_child_command_line_as_ps_shows_it_holds_no_token(tmp_path: Path) -> None:
    cfg = C.load(C.RunConfig, None, [f"--serve.run_dir={tmp_path}"])
    settle_admin_token(SECRET, "", tmp_path)
    cmd = serve_command(cfg.serve, tmp_path)
    # a process whose argv is the child's whole command line; read it back as ps does
    probe = [sys.executable, "-c", "import time; time.sleep(30)", *cmd]
    proc = subprocess.Popen(probe)
    try:
        cmdline = ""
        for _ in range(500):  # until the child has exec'd
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "serve.toml" in cmdline:
                break
            time.sleep(0.01)
        ps = subprocess.run(["ps", "-o", "args=", "-p", str(proc.pid)], capture_output=True, text=True).stdout
    finally:
        proc.kill()
        proc.wait()
    assert "serve.toml" in cmdline and SECRET not in cmdline and SECRET not in ps
