"""What an attacker tried against the sandboxes, as tests, on both backends (bubblewrap run as root
included: tests and CI run as root).

Each test is one finding: a command writing kernel settings, bubblewrap mapping the sandbox to host
root, a command tracing or signalling the exec agent, SysV IPC / POSIX queues / files outside /work
surviving a pool reset, a timed-out command's detached grandchild living on, and an OOM kill under
``sh`` reported as none. Every command here is the attacker; the host side only asks the agent.
Nothing waits on a clock: processes write their pids to files and the test polls the process table
through the agent, within a bound.
"""

from __future__ import annotations

import asyncio
import os
import textwrap
import uuid
from pathlib import Path

import pytest

from agentrl.sandbox import SandboxError, SandboxPool
from agentrl.sandbox.handle import Sandbox
from tests.test_sandbox import BACKENDS, config, needs_bwrap, run

PRELUDE = "import ctypes, os, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def pool_of(backend: str, **kw: object) -> SandboxPool:
    return SandboxPool(config(backend, **kw), f"t-{uuid.uuid4().hex[:8]}")


async def py(sb: Sandbox, code: str, timeout: float | None = None) -> str:
    """Run ``code`` (after PRELUDE) with python3 in the sandbox; its stdout (it must succeed)."""
    r = await sb.exec(["python3", "-c", PRELUDE + textwrap.dedent(code)], timeout=timeout)
    assert r.ok, r
    return r.stdout


async def agent_pid(sb: Sandbox) -> int:
    """The exec agent's pid inside the sandbox, as the agent itself reports it."""
    return int((await sb._call("ping", 5.0))["pid"])


# --- kernel settings and host uids ------------------------------------------------------------------

def test_a_command_cannot_open_kernel_settings_for_writing(backend: str) -> None:
    # Opened for writing and closed without a byte written: on the old bubblewrap backend the open
    # succeeded (a write of "|program" to core_pattern would have run as host root on a crash).
    code = """
        for path in ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/proc/sys/vm/overcommit_memory",
                     "/proc/sys/net/ipv4/ip_forward"):
            try:
                os.close(os.open(path, os.O_WRONLY))
                print("WRITABLE", path)
            except OSError as e:
                print("refused", path, e.errno)
        """

    async def body() -> None:
        async with pool_of(backend) as pool, pool.acquire() as sb:
            out = await py(sb, code)
            assert "WRITABLE" not in out and out.count("refused") == 4, out
    run(body())


def _host_processes_under(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                parents[int(name)] = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += [p for p, parent in parents.items() if parent == pid]
    return tree


@needs_bwrap
def test_bubblewrap_sandboxes_never_run_as_host_root() -> None:
    """Seen from the host: every process of the sandbox (bwrap itself included) has only non-zero
    uids, and the sandbox user namespace maps to a non-zero host uid."""
    async def body() -> None:
        async with pool_of("bubblewrap") as pool, pool.acquire() as sb:
            await sb.start_background(["sleep", "1000"])
            bwrap_pid = pool.backend._procs[sb.id].pid  # type: ignore[union-attr]
            own_userns = os.readlink("/proc/self/ns/user")
            sandboxed = 0
            for pid in _host_processes_under(bwrap_pid):
                status = Path(f"/proc/{pid}/status").read_text()
                uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
                assert "0" not in uids, f"pid {pid} runs with host uids {uids}"
                if os.readlink(f"/proc/{pid}/ns/user") != own_userns:
                    sandboxed += 1
                    for line in Path(f"/proc/{pid}/uid_map").read_text().splitlines():
                        inside, host, count = line.split()
                        assert host != "0", f"pid {pid}: uid {inside} maps to host root ({line.strip()})"
            assert sandboxed >= 2  # the agent and the sleep, at least
    run(body())


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="only a root owner could map the sandbox to host root")
def test_bubblewrap_refuses_a_root_sandbox_user_when_run_as_root() -> None:
    async def body() -> None:
        pool = pool_of("bubblewrap", user="0:0")
        with pytest.raises(SandboxError, match="host root"):
            await pool.start()
        await pool.close()
    run(body())


# --- the exec agent ---------------------------------------------------------------------------------

def test_a_command_cannot_trace_the_agent_or_open_its_memory_or_channel(backend: str) -> None:
    # If the attach worked (old code), the agent is waited for and detached at once so that the
    # rest of the run is not left with a stopped agent; nothing is written to its memory.
    code = """
        pid = int(sys.argv[1])
        if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH
            os.waitpid(pid, 0x40000000)  # __WALL
            libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
            print("ATTACHED")
        else:
            print("attach refused", ctypes.get_errno())
        try:
            os.close(os.open(f"/proc/{pid}/mem", os.O_RDWR))
            print("MEM OPENED")
        except OSError as e:
            print("mem refused", e.errno)
        # No other process of the box shows us its descriptors: the host channel is in none of them
        # (an init such as tini or bwrap's keeps the sandbox's stdin/stdout open).
        for p in os.listdir("/proc"):
            if p.isdigit() and int(p) != os.getpid():
                try:
                    print("FDS of", p, os.listdir(f"/proc/{p}/fd"))
                except OSError as e:
                    print("fds refused", p, e.errno)
        """

    async def body() -> None:
        async with pool_of(backend) as pool, pool.acquire() as sb:
            pid = await agent_pid(sb)
            r = await sb.exec(["python3", "-c", PRELUDE + textwrap.dedent(code), str(pid)])
            assert r.ok, r
            assert "attach refused 1" in r.stdout, r.stdout  # EPERM
            assert "MEM OPENED" not in r.stdout and "FDS of" not in r.stdout, r.stdout
            assert (await sb.exec("echo alive")).stdout == "alive\n"
    run(body())


def test_a_command_cannot_kill_or_stop_the_agent(backend: str) -> None:
    async def body() -> None:
        async with pool_of(backend) as pool, pool.acquire() as sb:
            pid = await agent_pid(sb)
            r = await sb.exec(f"kill -STOP {pid}; kill -KILL {pid}; kill -TERM {pid}; echo sent", timeout=10)
            assert r.stdout.endswith("sent\n") and not r.timed_out, r
            assert (await sb.exec("echo alive")).stdout == "alive\n"
    run(body())


# --- timeouts and OOM kills ---------------------------------------------------------------------------

DETACH = """
    def detach(path, orphan):
        # A child in a session of its own; with orphan, its own child, whose parent then exits.
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if orphan and os.fork():
                os._exit(0)
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(path + ".tmp", path)
            time.sleep(1000)
            os._exit(0)
        if orphan:
            os.waitpid(pid, 0)
    if sys.argv[1] == "hostile":
        libc.prctl(36, 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER off: our orphans go elsewhere
    detach(f"/work/{sys.argv[1]}-child.pid", False)
    detach(f"/work/{sys.argv[1]}-grandchild.pid", True)
    while not all(os.path.exists(f"/work/{sys.argv[1]}-{k}.pid") for k in ("child", "grandchild")):
        time.sleep(0.01)
    print("planted", flush=True)
    time.sleep(1000)
    """

ALIVE = """
    for path in sys.argv[1:]:
        pid = open(path).read()
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            print(path)
    """


def test_a_timed_out_commands_detached_descendants_are_killed(backend: str) -> None:
    async def body() -> None:
        async with pool_of(backend) as pool, pool.acquire() as sb:
            server = await sb.start_background(["sleep", "1000"])  # the episode's own: it stays
            pid_files = []
            for variant in ("plain", "hostile"):
                r = await sb.exec(["python3", "-c", PRELUDE + textwrap.dedent(DETACH), variant], timeout=5)
                assert r.timed_out and r.stdout == "planted\n", r
                pid_files += [f"/work/{variant}-child.pid", f"/work/{variant}-grandchild.pid"]
            alive = ["?"]
            for _ in range(100):  # bounded: the kill is synchronous, this only rides out the reaping
                r = await sb.exec(["python3", "-c", PRELUDE + textwrap.dedent(ALIVE), *pid_files])
                assert r.ok, r
                alive = r.stdout.split()
                if not alive:
                    break
                await asyncio.sleep(0.1)
            assert alive == [], f"still running after their command's timeout: {alive}"
            assert await server.poll() is None
    run(body())
