"""The engine reaper: a launched engine never outlives the process that launched it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _read_pid(path, timeout_s: float = 30.0) -> int:
    """The pid a started command writes to ``path``, once it is there."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, "the reaper did not start its child"
        time.sleep(0.05)
    return int(path.read_text())


def _spawn_owner(tmp_path) -> tuple[subprocess.Popen, int]:
    """A stand-in for serve: launches `sleep` through the reaper, prints the grandchild's pid."""
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-m", "agentrl.engines.reaper", "--", "sh", "-c",
                              "echo $$ > {tmp_path}/child.pid; exec sleep 600"])
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, AGENTRL_REAPER_GRACE_S="2"))
    return owner, _read_pid(tmp_path / "child.pid")


def test_a_kill_9_of_the_owner_takes_the_engine_down(tmp_path):
    owner, child = _spawn_owner(tmp_path)
    assert _alive(child)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert _wait_gone(child, 10), "the engine outlived its owner"


def test_a_sigterm_to_the_reaper_takes_its_whole_group_down(tmp_path):
    script = f"echo $$ > {tmp_path}/child.pid; sleep 600 & echo $! > {tmp_path}/grandchild.pid; wait"
    reaper = subprocess.Popen([sys.executable, "-m", "agentrl.engines.reaper", "--", "sh", "-c", script],
                              env=dict(os.environ, AGENTRL_REAPER_GRACE_S="2"))
    grandchild = _read_pid(tmp_path / "grandchild.pid")
    reaper.send_signal(signal.SIGTERM)
    reaper.wait(30)
    assert _wait_gone(grandchild, 10), "a grandchild of the engine survived"


def test_sigusr1_kills_the_whole_group_at_once_and_a_signal_death_exits_128_plus_n(tmp_path):
    # the child ignores SIGTERM: a graceful stop would wait out the grace; SIGUSR1 does not wait
    script = (f"trap '' TERM; echo $$ > {tmp_path}/child.pid; sleep "
              f"600 & echo $! > {tmp_path}/grandchild.pid; wait")
    reaper = subprocess.Popen([sys.executable, "-m", "agentrl.engines.reaper", "--", "sh", "-c", script],
                              env=dict(os.environ, AGENTRL_REAPER_GRACE_S="60"))
    grandchild = _read_pid(tmp_path / "grandchild.pid")
    t0 = time.monotonic()
    reaper.send_signal(signal.SIGUSR1)
    assert reaper.wait(10) == 128 + signal.SIGKILL
    assert time.monotonic() - t0 < 5
    assert _wait_gone(grandchild, 10), "a grandchild of the engine survived"


def test_what_a_reaper_killed_with_kill_9_leaves_is_ended_from_its_noted_group(tmp_path):
    from agentrl.engines.reaper import child_group, kill_group

    script = f"sleep 600 & echo $! > {tmp_path}/grandchild.pid; exec sleep 600"
    reaper = subprocess.Popen([sys.executable, "-m", "agentrl.engines.reaper", "--", "sh", "-c", script])
    grandchild = _read_pid(tmp_path / "grandchild.pid")
    group = child_group(reaper.pid)
    assert group is not None and os.getpgid(grandchild) == group
    reaper.send_signal(signal.SIGKILL)  # the reaper cannot pass anything on
    reaper.wait()
    assert _alive(grandchild)  # another session: it outlives the reaper
    assert kill_group(group)
    assert _wait_gone(grandchild, 10)


def test_a_child_that_exits_on_sigterm_is_not_held_for_the_grace_period(tmp_path):
    """The reaper returns once its child has exited, not at the end of the grace (an hour here):
    the escalation must see the exit it is waiting for."""
    script = f"trap 'exit 3' TERM; echo $$ > {tmp_path}/child.pid; sleep 600 & wait"
    reaper = subprocess.Popen([sys.executable, "-m", "agentrl.engines.reaper", "--", "sh", "-c", script],
                              env=dict(os.environ, AGENTRL_REAPER_GRACE_S="3600"))
    child = _read_pid(tmp_path / "child.pid")
    reaper.send_signal(signal.SIGTERM)
    assert reaper.wait(timeout=120) == 3  # the child's own exit code: it went on SIGTERM
    assert not _alive(child)


def test_the_command_is_stopped_when_its_reaper_is_killed_with_kill_9(tmp_path):
    """A process-group kill of whoever launched the reaper takes the reaper down with no chance to
    forward anything: its command gets SIGTERM from the kernel and stops itself."""
    script = (f"trap 'echo stopped > {tmp_path}/stopped; exit 0' TERM; "
              f"echo $$ > {tmp_path}/child.pid; sleep 600 & wait")
    reaper = subprocess.Popen([sys.executable, "-m", "agentrl.engines.reaper", "--", "sh", "-c", script])
    child = _read_pid(tmp_path / "child.pid")
    reaper.send_signal(signal.SIGKILL)
    reaper.wait()
    assert _wait_gone(child, 30), "the command outlived its reaper"
    assert (tmp_path / "stopped").read_text().strip() == "stopped"  # by its own SIGTERM handler


def test_the_commands_private_folder_is_removed_however_it_ends(tmp_path):
    """``--tmpdir``: an engine's unix sockets live there; gone after an exit, and after a kill -9 of
    the owner (the reaper's parent-death SIGTERM)."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "socket").write_text("")
    code = subprocess.run([sys.executable, "-m", "agentrl.engines.reaper", "--tmpdir", str(done), "--",
                           "sh", "-c", "exit 3"], timeout=60).returncode
    assert code == 3 and not done.exists()

    folder = tmp_path / "private"
    folder.mkdir()
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-m", "agentrl.engines.reaper", "--tmpdir", "{folder}", "--",
                              "sh", "-c", "echo $$ > {tmp_path}/child.pid; exec sleep 600"])
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, AGENTRL_REAPER_GRACE_S="2"))
    child = _read_pid(tmp_path / "child.pid")
    assert folder.exists()
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert _wait_gone(child, 10)
    deadline = time.monotonic() + 10
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not folder.exists(), "the private folder outlived the reaper"


def test_an_engines_private_folder_leaves_room_for_vllms_socket_paths(monkeypatch, tmp_path, caplog) -> None:
    """vLLM binds ZeroMQ sockets at <the engine's folder>/<uuid4>; a unix socket path holds 107 bytes.
    A temporary folder too long for that (pytest's, a user's TMPDIR) sends the engine's folder to
    /tmp, with one warning; a short one is used as it is."""
    import tempfile

    from agentrl.engines import vllm

    short = tmp_path.parents[len(tmp_path.parents) - 2]  # "/tmp" or the like
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    assert vllm.engine_tmp_parent() == str(short)
    long = tmp_path / ("x" * 60)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    with caplog.at_level("WARNING", logger="agentrl.engines.vllm"):
        assert vllm.engine_tmp_parent() == "/tmp" and vllm.engine_tmp_parent() == "/tmp"
    assert sum("too long a path" in r.getMessage() for r in caplog.records) == 1
    folder = tempfile.mkdtemp(prefix="agentrl-engine-", dir=vllm.engine_tmp_parent())
    try:
        assert len(f"{folder}/{'0' * 36}".encode()) <= 107
    finally:
        os.rmdir(folder)


def test_a_benchmark_killed_takes_the_processes_it_started_with_it(tmp_path):
    """The benchmarks start their runs, services and engines with ``tied_to_this_process()``: a benchmark
    ended by SIGTERM (Python's default: no cleanup runs) or by SIGKILL leaves none of them behind."""
    bench = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pidfile = tmp_path / f"child-{sig}.pid"
        script = textwrap.dedent(f"""
            import subprocess, sys, time
            sys.path.insert(0, {bench!r})
            from common import tied_to_this_process
            child = subprocess.Popen(["sleep", "600"], preexec_fn=tied_to_this_process())
            open({str(pidfile)!r}, "w").write(str(child.pid))
            time.sleep(600)
        """)
        benchmark = subprocess.Popen([sys.executable, "-c", script])
        child = _read_pid(pidfile)
        assert _alive(child)
        benchmark.send_signal(sig)
        benchmark.wait(10)
        assert _wait_gone(child, 10), f"the benchmark's child outlived it after signal {sig}"


def _processes_with(arg: str) -> list[int]:
    """Live processes whose command line holds ``arg``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if arg.encode() in f.read().split(b"\0") and _alive(int(entry)):
                        out.append(int(entry))
            except OSError:
                continue
    return out


def test_a_launcher_killed_while_its_reaper_starts_leaves_no_command_behind(tmp_path):
    """serve launches an engine's reaper and is killed a moment later, before the reaper (still
    importing) has asked for a signal on its parent's death: the reaper must not go on to start the
    engine as an orphan nobody stops (seen in a chaos run: an engine of a killed serve held its port
    for 35 minutes and every later serve failed to start). The launcher here exits right after the
    launch, as a ``kill -9`` would end it; its reaper's command never runs, or dies with it."""
    marker = f"{600 + os.getpid() % 1000}.{time.time_ns() % 10**6}"  # sleep's argument, unique
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        from agentrl.procs import tied_to_this_process
        subprocess.Popen([sys.executable, "-m", "agentrl.engines.reaper", "--", "sleep", {marker!r}],
                         preexec_fn=tied_to_this_process())
        os._exit(0)
    """)
    for _ in range(3):
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    time.sleep(8)  # a reaper that survived has imported and launched its command by now
    left = _processes_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the command outlived its launcher: pids {left}"
