"""`agentrl run`, the quickstart's last step, on a fresh run directory: serve + learner on one machine."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest

from tests.conftest import agentrl_run, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]


def test_agentrl_run_trains_three_steps_and_prints_each(tmp_path, tiny_tools_model):
    out = agentrl_run(
        tmp_path / "run", "--serve.env.group_size=2", "--serve.buffer.batch_size=4", "--learn.steps=3",
        "--eval.tasks=6",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for k in (1, 2, 3):
        assert any(
            line.startswith(f"step {k} | version {k} | reward ") and "staleness" in line for line in lines
        )
    summary = json.loads(lines[-1])
    assert summary["steps"] == 3 and summary["final_version"] == 3
    assert (tmp_path / "run" / "episodes.jsonl").exists()
    # Held-out evaluation before the first step and after the last, on the same tasks.
    assert (
        summary["eval_tasks"] == 6
        and 0 <= summary["success_before"] <= 1
        and 0 <= summary["success_after"] <= 1
    )
    before = json.loads((tmp_path / "run" / "eval_before.json").read_text())
    after = json.loads((tmp_path / "run" / "eval_after.json").read_text())
    assert len(before["episodes"]) == len(after["episodes"]) == 6
    assert [e["task_id"] for e in before["episodes"]] == [e["task_id"] for e in after["episodes"]]
    assert any(line.startswith("success on held-out tasks: ") for line in lines)
    assert list((tmp_path / "run" / "plots").glob("*.png"))


def test_agentrl_run_starts_a_killed_serve_again_and_trains_to_the_end(tmp_path, tiny_tools_model):
    """kill -9 of the serve child mid-run: agentrl run starts serve again on the run directory (at
    the learner's version), the learner rides out the outage, and the run finishes every step."""
    from tests.chaos_harness import running_pids

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    cmd = [
        sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={run_dir}",
        f"--serve.router.port={free_port()}", f"--serve.engine.base_port={free_port()}",
        "--serve.model=tiny-tools", "--serve.env.group_size=2", "--serve.buffer.batch_size=4",
        "--learn.steps=4", "--eval.tasks=0",
    ]
    with open(tmp_path / "run.out", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        loaded = run_dir / "weights" / "v1" / "loaded.json"  # the engine serves the first published version
        while not loaded.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run.out").read_text()[
                -3000:
            ]
            time.sleep(0.5)
        serve = running_pids(f"agentrl.cli serve --config {run_dir}/serve.toml")  # serve, not its reaper
        assert len(serve) == 1, serve
        os.kill(serve[0], signal.SIGKILL)
        proc.wait(900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    text = (tmp_path / "run.out").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "serve exited with code 137; starting it again" in text  # 128 + 9, as its reaper reports a kill -9
    summary = json.loads(text.strip().splitlines()[-1])
    exits = [line for line in text.splitlines() if "serve exited" in line or "serve's reaper" in line]
    assert summary["steps"] == 4 and summary["final_version"] == 4, summary
    assert summary["serve_restarts"] == 1, (exits, (run_dir / "serve.log").read_text()[-6000:])
    # the second serve came back at a published version, not the base weights
    assert "restored policy version" in (run_dir / "serve.log").read_text()


def test_ctrl_c_during_training_leaves_no_process_nor_container_and_names_the_run_directory(
    tmp_path, tiny_tools_model
):
    """Ctrl-C in the terminal (SIGINT to ``agentrl run``'s whole foreground process group) once the
    learner has printed a step: the run exits with 130, no process it started is left (serve, the
    reapers, the vLLM engine), neither are its sandbox containers nor anything on its ports, and
    it says where the run directory is."""
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    router_port, engine_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
    cmd = [
        sys.executable, "-m", "agentrl.cli", "run", f"--serve.run_dir={run_dir}",
        f"--serve.router.port={router_port}", f"--serve.engine.base_port={engine_port}",
        "--serve.model=tiny-tools", "--serve.env.group_size=2", "--serve.buffer.batch_size=4",
        "--learn.steps=1000", "--eval.tasks=0", f'--serve.sandbox.labels={{agentrl_test = "{tag}"}}',
    ]
    # a session of its own, as a shell's foreground job: the group's SIGINT reaches it and its children only
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    lines: list[str] = []
    stepped = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append(raw.decode(errors="replace").rstrip())
            if lines[-1].startswith("step 1 | "):
                stepped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        stepped.wait(900)
        assert stepped.is_set() and proc.poll() is None, "\n".join(lines[-40:])
        children = psutil.Process(proc.pid).children(recursive=True)
        started = [(c.pid, c.create_time()) for c in children]
        commands = [" ".join(c.cmdline()) for c in children]
        for what in ("agentrl.cli serve", "vllm.entrypoints.openai.api_server", "agentrl.engines.reaper"):
            assert any(what in c for c in commands), commands
        assert containers(tag), "the run has no sandbox container to leave behind"
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(180)  # a bound for the test, not a timing claim: serve waits up to 15 s per stage
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    reader.join(30)
    out = "\n".join(lines)
    assert code == 130, out[-3000:]
    assert f"interrupted; kept {run_dir}" in out, out[-3000:]
    left = [pid for pid, created in started if alive(pid, created)]
    assert not left, [psutil.Process(pid).cmdline() for pid in left if psutil.pid_exists(pid)]
    assert not containers(tag), out[-3000:]
    for port in (router_port, engine_port):  # nothing listens there any more (closed connections may linger)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()


def containers(tag: str) -> list[str]:
    """Ids of the containers carrying this test run's label, running or not."""
    out = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=agentrl_test={tag}"], capture_output=True, text=True,
        check=True,
    )
    return out.stdout.split()


def alive(pid: int, created: float) -> bool:
    """The process ``pid`` started at ``created`` still exists (not a later one with its pid, nor a
    zombie)."""
    try:
        p = psutil.Process(pid)
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
