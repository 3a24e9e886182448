"""Behavioural tests of agentrl.sandbox against the real backends (Docker engine, bubblewrap).

Each behavioural test runs on both backends where it applies: `docker` tests need a Docker engine
with the base image built (`agentrl sandbox build`); bubblewrap tests need `bwrap`.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from agentrl.sandbox import ExecResult, SandboxConfig, SandboxError, SandboxPool
from agentrl.sandbox.backend import owner_is_dead, owner_labels
from agentrl.sandbox.docker_api import DockerAPI

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
BACKENDS = [pytest.param("docker", marks=pytest.mark.docker, id="docker"),
            pytest.param("bubblewrap", marks=needs_bwrap, id="bubblewrap")]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def config(backend: str, **kw: object) -> SandboxConfig:
    base: dict = dict(backend=backend, warm=1, max_concurrency=4, memory_mb=256, pids=64, exec_timeout_s=20.0)
    base.update(kw)
    return SandboxConfig(**base)


def run(coro):  # plain functions + asyncio.run: no async test plugin needed
    return asyncio.run(coro)


def docker_ids(label: str) -> list[str]:
    out = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label={label}"], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def host_is_healthy() -> bool:
    t0 = time.monotonic()
    ok = subprocess.run(["true"], timeout=10).returncode == 0
    return ok and time.monotonic() - t0 < 5


# --- what a command sees and gets back ------------------------------------------------------------

def test_a_command_runs_as_nobody_in_work_and_returns_a_structured_result(backend: str) -> None:
    async def body() -> None:
        async with SandboxPool(config(backend), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                assert sb.id
                r = await sb.exec("echo out; echo err >&2; id -u; pwd; exit 3")
                assert isinstance(r, ExecResult)
                assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n65534\n/work\n", "err\n")
                assert not r.timed_out and not r.oom_killed and r.duration_s > 0
                r = await sb.exec(["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin="abc")
                assert r.ok and r.stdout == "cba\n"
                assert (await sb.exec(["no-such-binary"])).exit_code == 127
            assert pool.stats()["exec_count"] == 3
    run(body())


@needs_bwrap
def test_bubblewrap_sandboxes_start_under_the_private_umask_serve_runs_with() -> None:
    """serve makes its files private (umask 077), so the cgroup folders it creates are 0700 unless
    it opens them up: the unprivileged user bwrap runs as could then not reach the OOM counter it
    binds into the box, and every sandbox failed to start (serve exited when Docker was absent)."""
    async def body() -> None:
        async with SandboxPool(config("bubblewrap"), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                assert (await sb.exec("echo ok")).stdout == "ok\n"

    old = os.umask(0o077)
    try:
        run(body())
    finally:
        os.umask(old)


def test_files_round_trip_and_writes_outside_work_are_refused(backend: str) -> None:
    async def body() -> None:
        async with SandboxPool(config(backend), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                await sb.write_file("/work/pkg/a.py", "print(6 * 7)")
                assert await sb.read_file("/work/pkg/a.py") == b"print(6 * 7)"
                await sb.write_file("/work/blob", bytes(range(256)))
                assert await sb.read_file("/work/blob") == bytes(range(256))
                assert (await sb.exec(["python3", "pkg/a.py"])).stdout == "42\n"
                for path in ("/etc/evil", "/usr/evil", "/evil"):
                    with pytest.raises(OSError):
                        await sb.write_file(path, "x")
                    assert (await sb.exec(f"echo x > {path}")).exit_code != 0
                with pytest.raises(FileNotFoundError):
                    await sb.read_file("/work/missing")
    run(body())


def test_host_paths_are_not_visible(backend: str, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("do not read me")
    repo_file = Path(__file__).resolve()

    async def body() -> None:
        async with SandboxPool(config(backend), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                for path in (secret, repo_file, Path("/var/run/docker.sock"), Path("/root")):
                    r = await sb.exec(["ls", str(path)])
                    assert r.exit_code != 0, f"{path} is visible in the sandbox: {r.stdout}"
                r = await sb.exec("cat /proc/1/environ; cat /etc/shadow")
                assert "do not read me" not in r.stdout
    run(body())


def test_network_connections_fail(backend: str) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    code = textwrap.dedent(f"""
        import socket
        for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
            s = socket.socket(); s.settimeout(3)
            try:
                s.connect(addr); print("CONNECTED", addr)
            except OSError as e:
                print("refused", addr, e)
        """)

    async def body() -> None:
        async with SandboxPool(config(backend), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                r = await sb.exec(["python3", "-c", code], timeout=15)
                assert r.exit_code == 0, r.stderr
                assert "CONNECTED" not in r.stdout and r.stdout.count("refused (") == 3
    try:
        run(body())
    finally:
        listener.close()


# --- limits ---------------------------------------------------------------------------------------

def test_a_fork_bomb_hits_the_pids_limit_and_the_host_stays_healthy(backend: str) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"

    async def body() -> None:
        async with SandboxPool(config(backend, pids=64), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                r = await sb.exec(["python3", "-c", bomb], timeout=4)
                assert r.timed_out and r.exit_code == 124
                assert host_is_healthy()
                # The group is gone: the box answers again, with few processes left.
                r = await sb.exec(["python3", "-c", "import os; print(sum(p.isdigit() "
                                                    "for p in os.listdir('/proc')))"])
                assert r.ok and int(r.stdout) < 10
            async with pool.acquire() as sb:  # the timed-out box was replaced; a fresh one works
                assert (await sb.exec("echo ok")).stdout == "ok\n"
    run(body())
    assert host_is_healthy()


def test_a_memory_hog_is_oom_killed_and_reported(backend: str) -> None:
    hog = "chunks = []\nwhile True:\n    chunks.append(b'x' * (16 << 20))\n"

    async def body() -> None:
        async with SandboxPool(config(backend, memory_mb=128), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                r = await sb.exec(["python3", "-c", hog], timeout=30)
                assert r.oom_killed and r.exit_code == 137 and not r.timed_out, r
                assert (await sb.exec("echo alive")).stdout == "alive\n"  # the agent survived
            assert pool.stats()["oom_kills"] == 1
    run(body())
    assert host_is_healthy()


def test_an_infinite_loop_is_killed_at_its_timeout_and_the_box_is_replaced(backend: str) -> None:
    async def body() -> None:
        async with SandboxPool(config(backend, warm=0), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                t0 = time.monotonic()
                r = await sb.exec("sleep 1000 & while true; do :; done", timeout=1.0)
                assert r.timed_out and r.exit_code == 124
                assert time.monotonic() - t0 < 30  # the 1 s timeout, not the command's 1000 s
                first = sb.id
            await pool.wait_idle()
            # removed: Docker may still list it for a moment while its removal finishes (a 409)
            deadline = time.monotonic() + 30
            while first in await pool.live_ids():
                assert time.monotonic() < deadline, "the timed-out box was not removed"
                await asyncio.sleep(0.1)
            async with pool.acquire() as sb:
                assert sb.id != first
    run(body())


# --- reuse and leaks --------------------------------------------------------------------------------

def test_a_reset_box_has_no_trace_of_the_previous_episode(backend: str) -> None:
    async def body() -> None:
        async with SandboxPool(config(backend, warm=1), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                await sb.write_file("/work/secret.txt", "episode one")
                await sb.exec("mkdir -p /work/d/e && touch /work/.hidden "
                              "/tmp/t /dev/shm/s && chmod 500 /work/d")
                await sb.start_background(["sleep", "1000"])
                first = sb.id
            await pool.wait_idle()
            async with pool.acquire() as sb:
                assert sb.id == first and pool.stats()["resets"] == 1  # the same box, reset
                r = await sb.exec("ls -A /work /tmp /dev/shm; ls /proc | grep -c '^[0-9]'")
                assert "secret" not in r.stdout and ".hidden" not in r.stdout and "t\n" not in r.stdout
                assert int(r.stdout.split()[-1]) <= 5, r.stdout  # init, agent, sh, ls, grep
            with pytest.raises(SandboxError):  # a released handle is dead for good
                await sb.exec("true")
    run(body())


def test_background_processes_can_be_polled_read_and_killed(backend: str) -> None:
    async def body() -> None:
        async with SandboxPool(config(backend), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                srv = await sb.start_background(["python3", "-m", "http.server", "8000"])
                fetch = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000').status)"
                for _ in range(50):
                    r = await sb.exec(["python3", "-c", fetch])
                    if r.ok:
                        break
                    await asyncio.sleep(0.1)
                assert r.stdout == "200\n"
                assert await srv.poll() is None
                assert "GET /" in await srv.output()
                await srv.kill()
                assert await srv.poll() == 137
    run(body())


def test_500_episodes_with_30_percent_cancelled_leave_nothing_behind(backend: str) -> None:
    rng = random.Random(5)

    async def episode(pool: SandboxPool, i: int) -> None:
        async with pool.acquire() as sb:
            await sb.write_file(f"/work/{i}.txt", str(i))
            r = await sb.exec(["cat", f"/work/{i}.txt"])
            assert r.stdout == str(i)
            if i % 7 == 0:
                await sb.exec("sleep 0.2")

    async def body() -> None:
        cfg = config(backend, warm=4, max_concurrency=16, max_reuses=100)
        async with SandboxPool(cfg, f"t-{uuid.uuid4().hex[:8]}") as pool:
            tasks = [asyncio.create_task(episode(pool, i)) for i in range(500)]
            cancelled = rng.sample(range(500), 150)
            for i in cancelled:
                await asyncio.sleep(rng.uniform(0, 0.01))
                tasks[i].cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            errors = [
                r
                for r in results
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)
            ]
            assert not errors, errors[:3]
            await pool.wait_idle()
            stats = pool.stats()
            assert stats["in_use"] == 0 and stats["infra_errors"] == 0
            assert len(await pool.live_ids()) == stats["warm"]  # every live box is an idle one
            instance = pool.instance_id
        if backend == "docker":
            assert docker_ids(f"agentrl.instance={instance}") == []
        assert await pool.live_ids() == []
    run(body())


CHILD = """
import asyncio, sys
from agentrl.sandbox import SandboxConfig, SandboxPool
async def main():
    pool = SandboxPool(SandboxConfig(backend=sys.argv[1], warm=3), instance_id=sys.argv[2])
    await pool.start()
    async with pool.acquire() as sb:
        await sb.start_background(["sleep", "1000"])
        print("ready", flush=True)
        await asyncio.sleep(1000)
asyncio.run(main())
"""


def test_after_kill_9_of_the_owner_the_next_start_removes_every_leftover(backend: str) -> None:
    instance = f"t-victim-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, backend, instance],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        if backend == "docker":
            assert len(docker_ids(f"agentrl.instance={instance}")) >= 3
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()

    async def body() -> None:
        async with SandboxPool(config(backend), f"t-{uuid.uuid4().hex[:8]}"):
            if backend == "docker":
                assert docker_ids(f"agentrl.instance={instance}") == []
            else:  # bwrap sandboxes die with their owner; their cgroups are reaped here
                assert subprocess.run(["pgrep", "-f", "sleep 1000"], capture_output=True).stdout == b""
    run(body())


@pytest.mark.docker
def test_start_removes_containers_whose_owner_pid_is_dead() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    labels = {**owner_labels("t-ghost"), "agentrl.pid": str(dead.pid)}
    assert owner_is_dead(labels)
    assert not owner_is_dead(owner_labels("t-alive"))

    async def body() -> None:
        api = DockerAPI(SandboxConfig().resolved_docker_host())
        cid = await api.create({"Image": "agentrl/base:bookworm", "Cmd": ["sleep", "1000"], "Labels": labels})
        await api.start(cid)
        await api.close()
        async with SandboxPool(config("docker", warm=0), f"t-{uuid.uuid4().hex[:8]}") as pool:
            assert pool.stats()["reaped"] >= 1
        assert cid not in docker_ids("agentrl.sandbox")
    run(body())


@pytest.mark.docker
def test_containers_are_locked_down() -> None:
    async def body() -> None:
        async with SandboxPool(
            config("docker", memory_mb=256, pids=64, cpus=0.5), f"t-{uuid.uuid4().hex[:8]}"
        ) as pool:
            async with pool.acquire() as sb:
                info = await DockerAPI(SandboxConfig().resolved_docker_host()).inspect(sb.id)
                assert info is not None
                hc = info["HostConfig"]
                # No --init: the agent is pid 1 itself, so no init holds its channel (execd.py).
                assert hc["NetworkMode"] == "none" and hc["ReadonlyRootfs"] and not hc["Init"]
                assert "/proc/sys" in hc["ReadonlyPaths"]
                assert hc["CapDrop"] == ["ALL"] and "no-new-privileges" in hc["SecurityOpt"]
                assert hc["Memory"] == hc["MemorySwap"] == 256 * 2**20
                assert hc["PidsLimit"] == 64 and hc["NanoCpus"] == 5 * 10**8
                assert not hc.get("Binds") and info["Mounts"] == []
                assert info["Config"]["User"] == "65534:65534"
                assert info["Config"]["Labels"]["agentrl.instance"] == pool.instance_id
                assert info["Config"]["Labels"]["agentrl.pid"] == str(os.getpid())
    run(body())


@pytest.mark.docker
def test_a_vanished_container_is_an_infrastructure_error_and_is_counted() -> None:
    async def body() -> None:
        async with SandboxPool(config("docker"), f"t-{uuid.uuid4().hex[:8]}") as pool:
            async with pool.acquire() as sb:
                subprocess.run(["docker", "rm", "-f", sb.id], capture_output=True, check=True)
                with pytest.raises(SandboxError):
                    for _ in range(20):
                        await sb.exec("true")
                        await asyncio.sleep(0.1)
            assert pool.stats()["infra_errors"] >= 1
    run(body())


def test_an_unreachable_engine_is_a_sandbox_error() -> None:
    async def body() -> None:
        pool = SandboxPool(SandboxConfig(backend="docker", docker_host="unix:///nonexistent/docker.sock"))
        with pytest.raises(SandboxError, match="unreachable"):
            await pool.start()
        await pool.close()
    run(body())


def test_close_completes_even_when_its_caller_is_cancelled(backend: str) -> None:
    async def body() -> None:
        pool = SandboxPool(config(backend, warm=2), f"t-{uuid.uuid4().hex[:8]}")
        await pool.start()
        closing = asyncio.create_task(pool.close())
        await asyncio.sleep(0)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        # The shutdown goes on without its caller; a second close() waits for that same shutdown.
        await pool.close()
        assert await pool.backend.live_ids() == []
    run(body())


def test_config_errors_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="backend"):
        SandboxConfig(backend="podman")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxConfig(memory_mb=8)
