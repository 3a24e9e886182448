"""``agentrl doctor`` says what is missing, one line per check, and exits 1 for what agentrl cannot
run without: each failure below is made for real (a socket that does not exist, a PATH without
bwrap, a port bound here, an empty model cache, a run directory that cannot be written), and the
machine as set up by scripts/setup.sh passes."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def doctor(tmp_path: Path, *settings: str, env: dict[str, str] | None = None,
           python: tuple[str, ...] = (sys.executable,)) -> tuple[int, dict[str, tuple[str, str]], str]:
    """``agentrl doctor`` on free ports with a run directory under ``tmp_path`` and the tiny-tools
    model, then ``settings``: (exit code, {check: (status, line)}, the whole output)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [*python, "-m", "agentrl.cli", "doctor", f"--serve.run_dir={tmp_path / 'run'}",
           f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
           "--serve.model=tiny-tools", *settings]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=full_env)
    lines = {}
    for line in out.stdout.splitlines():
        status, name = line[:8].strip(), line[9:21].strip()
        if status in ("ok", "warning", "missing"):
            lines[name] = (status, line)
    return out.returncode, lines, out.stdout + out.stderr


def missing(lines: dict[str, tuple[str, str]]) -> set[str]:
    return {name for name, (status, _) in lines.items() if status == "missing"}


def only_missing(check: str, tmp_path: Path, *settings: str, env: dict[str, str] | None = None) -> str:
    """``agentrl doctor`` with ``settings`` exits 1 with ``check`` the only line marked missing: that line."""
    code, lines, out = doctor(tmp_path, *settings, env=env)
    assert code == 1, out
    assert missing(lines) == {check}, out
    return lines[check][1]


@pytest.fixture
def built(tiny_tools_model: str) -> str:
    """The tiny-tools model is in the cache, so that only what a test breaks is missing."""
    return tiny_tools_model


@pytest.mark.docker
def test_doctor_exits_0_on_a_machine_set_up_by_setup_sh(tmp_path: Path, built: str) -> None:
    code, lines, out = doctor(tmp_path)
    assert code == 0, out
    assert not missing(lines), out
    for name in ("docker", "ports", "engine", "packages", "model", "run dir"):  # what setup provides
        assert lines[name][0] == "ok", out
    assert out.rstrip().endswith("warnings)"), out


def test_doctor_says_docker_is_missing_when_docker_host_names_no_socket(tmp_path: Path, built: str) -> None:
    sock = tmp_path / "nothing-here.sock"
    code, lines, out = doctor(
        tmp_path, "--serve.sandbox.backend=docker", env={"DOCKER_HOST": f"unix://{sock}"}
    )
    assert code == 1, out
    assert missing(lines) == {"docker"}, out
    status, line = lines["docker"]
    assert f"no Docker engine answers at unix://{sock}" in line and "fix: start the engine" in line


@pytest.mark.docker
def test_doctor_checks_every_engine_of_docker_hosts(tmp_path: Path, built: str) -> None:
    default, gone = "unix:///var/run/docker.sock", f"unix://{tmp_path / 'nothing-here.sock'}"
    both = f'--serve.sandbox.docker_hosts=["{default}", "{gone}"]'
    code, lines, out = doctor(tmp_path, "--serve.sandbox.backend=docker", both)
    assert code == 1 and missing(lines) == {"docker"}, out
    line = lines["docker"][1]
    assert "1 of 2 Docker engines of sandbox.docker_hosts answer" in line, out
    assert f"{gone}: no Docker engine answers" in line and default + ":" not in line, out
    assert "take it out of sandbox.docker_hosts" in line, out
    code, lines, out = doctor(tmp_path, "--serve.sandbox.backend=docker",
                              f'--serve.sandbox.docker_hosts=["{default}"]')
    assert code == 0 and lines["docker"][0] == "ok", out
    assert "1 of 1 Docker engines of sandbox.docker_hosts answer" in lines["docker"][1], out


@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap (scripts/setup.sh installs it)")
def test_a_missing_docker_engine_is_a_warning_where_bubblewrap_stands_in(tmp_path: Path, built: str) -> None:
    sock = tmp_path / "nothing-here.sock"
    code, lines, out = doctor(tmp_path, env={"DOCKER_HOST": f"unix://{sock}"})  # sandbox.backend = auto
    assert code == 0, out
    assert lines["docker"][0] == "warning" and "sandboxes will use bubblewrap" in lines["docker"][1], out
    assert lines["bubblewrap"][0] == "ok", out


def test_doctor_says_bubblewrap_is_missing_when_it_is_not_on_path(tmp_path: Path, built: str) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    line = only_missing(
        "bubblewrap", tmp_path, "--serve.sandbox.backend=bubblewrap", env={"PATH": str(empty)}
    )
    assert "'bwrap' is not on PATH" in line and "apt-get install bubblewrap" in line


def test_doctor_says_a_taken_port_is_missing(tmp_path: Path, built: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        line = only_missing("ports", tmp_path, f"--serve.router.port={port}")
    assert f"127.0.0.1:{port} (router.port) cannot be bound" in line and "--serve.router.port=N" in line


def test_doctor_says_an_unbuilt_model_is_missing_and_how_to_build_it(tmp_path: Path, built: str) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    # smollm2 is converted from its PyPI wheel, never shipped (the tiny models are: see the next test)
    line = only_missing("model", tmp_path, "--serve.model=smollm2", env={"AGENTRL_HOME": str(cache)})
    assert f"smollm2 is not built in {cache}/models/smollm2-135m" in line, line
    assert "serve builds it on first use" in line and "fix: agentrl model build smollm2" in line


def test_doctor_finds_a_shipped_model_that_is_not_in_the_cache_yet(tmp_path: Path, built: str) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    code, lines, out = doctor(tmp_path, env={"AGENTRL_HOME": str(cache)})
    assert lines["model"][0] == "ok" and "tiny-tools is shipped with agentrl" in lines["model"][1], out


def test_doctor_says_a_run_directory_under_a_file_cannot_be_made(tmp_path: Path, built: str) -> None:
    (tmp_path / "a-file").write_text("")
    line = only_missing("run dir", tmp_path, f"--serve.run_dir={tmp_path / 'a-file' / 'run'}")
    assert f"{tmp_path / 'a-file'} is not a folder" in line


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` (needs root, as CI runs): root ignores permission bits, but not a
    read-only mount nor a full one."""
    path.mkdir()
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_doctor_says_a_read_only_run_directory_is_missing(tmp_path: Path, built: str) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=64m") as ro:
        line = only_missing("run dir", tmp_path, f"--serve.run_dir={ro / 'run'}")
    assert f"cannot write in {ro} (Read-only file system)" in line


def test_doctor_says_a_run_directory_on_a_nearly_full_disk_is_missing(tmp_path: Path, built: str) -> None:
    with tmpfs(tmp_path / "small", "size=16m") as small:
        line = only_missing("run dir", tmp_path, f"--serve.run_dir={small / 'run'}")
    assert "less than 256 MiB" in line


def test_doctor_runs_on_the_standard_library_alone_before_setup(tmp_path: Path) -> None:
    # -S: no site-packages at all, as the system python3 has before scripts/setup.sh made the venv
    code, lines, out = doctor(tmp_path, "--before-setup", python=(sys.executable, "-S"))
    assert "Traceback" not in out, out
    assert {"python", "docker", "bubblewrap", "ports", "engine", "model", "run dir"} <= set(lines), out
    # what setup installs is never what stops the quickstart
    assert lines["packages"][0] != "missing" and lines["engine"][0] != "missing", out
    assert code == (1 if missing(lines) else 0), out


def test_quickstart_stops_before_installing_anything_when_a_port_is_taken(tmp_path: Path) -> None:
    # the quickstart's own script in a copy of the checkout whose setup.sh only leaves a mark
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "quickstart.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "setup.sh").write_text(f"touch {tmp_path / 'setup-ran'}\n")
    (tmp_path / "agentrl").symlink_to(ROOT / "agentrl")
    (tmp_path / "environments").symlink_to(ROOT / "environments")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        out = subprocess.run(
            [
                "bash",
                str(tmp_path / "scripts" / "quickstart.sh"),
                f"--serve.router.port={port}",
                f"--serve.run_dir={tmp_path / 'run'}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHON": sys.executable},
        )
    assert out.returncode == 1, out.stdout + out.stderr
    assert not (tmp_path / "setup-ran").exists()
    assert f"127.0.0.1:{port} (router.port) cannot be bound" in out.stdout
    assert "stopped before installing anything" in out.stderr
