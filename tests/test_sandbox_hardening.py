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
import shlex
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from agentrl.sandbox import SandboxError, SandboxPool
from agentrl.sandbox.handle import Sandbox
from tests.test_sandbox import BACKENDS, config, host_is_healthy, needs_bwrap, run

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
        for path in ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe",
                     "/proc/sys/vm/overcommit_memory", "/proc/sys/net/ipv4/ip_forward"):
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


# --- what a reset leaves behind -----------------------------------------------------------------------

async def _two_episodes_on_one_box(backend: str, first: object, second: object) -> None:
    """Run ``first(sb)`` then ``second(sb)`` in two episodes that get the same (reset) box."""
    async with pool_of(backend, warm=1, max_reuses=5) as pool:
        async with pool.acquire() as sb:
            await first(sb)  # type: ignore[operator]
            box = sb.id
        await pool.wait_idle()
        async with pool.acquire() as sb:
            assert sb.id == box and pool.stats()["resets"] == 1, "the second episode must reuse the box"
            await second(sb)  # type: ignore[operator]


SYSV_LIST = """
    for kind in ("shm", "sem", "msg"):
        rows = open("/proc/sysvipc/" + kind).read().splitlines()[1:]
        print(kind, len([r for r in rows if r.strip()]))
    """


def test_a_reset_removes_sysv_shared_memory_semaphores_and_message_queues(backend: str) -> None:
    make = """
        IPC_CREAT = 0o1000
        for key in (0x41475201, 0):  # a named key and IPC_PRIVATE
            assert libc.shmget(key, 4096, IPC_CREAT | 0o666) >= 0
            assert libc.semget(key, 1, IPC_CREAT | 0o666) >= 0
            assert libc.msgget(key, IPC_CREAT | 0o666) >= 0
        """
    attach = PRELUDE + textwrap.dedent("""
        shm = libc.shmget(0x41475202, 4096, 0o1666)
        libc.shmat.restype = ctypes.c_void_p
        assert libc.shmat(shm, None, 0) not in (None, 2**64 - 1)
        open("/work/attached", "w").write("yes")
        time.sleep(1000)
        """)

    async def first(sb: Sandbox) -> None:
        await py(sb, make)
        await sb.start_background(["python3", "-c", attach])  # holds a segment attached at reset
        for _ in range(200):
            if (await sb.exec("cat /work/attached")).stdout == "yes":
                break
            await asyncio.sleep(0.05)
        assert await py(sb, SYSV_LIST) == "shm 3\nsem 2\nmsg 2\n"

    async def second(sb: Sandbox) -> None:
        assert await py(sb, SYSV_LIST) == "shm 0\nsem 0\nmsg 0\n"
        assert "-1" == (await py(sb, "print(libc.shmget(0x41475201, 0, 0))")).strip()
    run(_two_episodes_on_one_box(backend, first, second))


def test_a_reset_removes_posix_message_queues(backend: str) -> None:
    async def first(sb: Sandbox) -> None:
        out = await py(sb, "print(libc.mq_open(b'/agentrl-probe', os.O_CREAT | os.O_RDWR, 0o600, None))")
        assert int(out) >= 0

    async def second(sb: Sandbox) -> None:
        out = await py(sb, "print(libc.mq_open(b'/agentrl-probe', os.O_RDONLY), ctypes.get_errno())")
        assert out.split() == ["-1", "2"], out  # ENOENT
    run(_two_episodes_on_one_box(backend, first, second))


MOUNT_POINTS = """
    points = []
    for line in open("/proc/self/mountinfo"):
        point = line.split()[4].replace("\\\\040", " ")
        if os.path.isdir(point) and not os.path.islink(point):
            points.append(point)
    """


def test_a_reset_leaves_no_file_in_any_writable_mount(backend: str) -> None:
    """A file planted in every mount the command can write to (/dev on the old bubblewrap backend,
    /dev/mqueue on Docker, ...) is gone in the next episode."""
    plant = MOUNT_POINTS + """
    for point in sorted(set(points + ["/dev"])):
        path = os.path.join(point, "agentrl-probe")
        try:
            open(path, "w").close()
            print(path)
        except OSError:
            pass
    """

    async def first(sb: Sandbox) -> None:
        planted = (await py(sb, plant)).split()
        assert "/work/agentrl-probe" in planted and "/tmp/agentrl-probe" in planted, planted
        await sb.write_file("/work/planted", "\n".join(planted))

    async def second(sb: Sandbox) -> None:
        left = await py(sb, MOUNT_POINTS + """
    for point in sorted(set(points + ["/dev"])):
        if os.path.lexists(os.path.join(point, "agentrl-probe")):
            print(point)
    """)
        assert left == "", f"left from the previous episode in: {left.split()}"
        with pytest.raises(FileNotFoundError):
            await sb.read_file("/work/planted")
    run(_two_episodes_on_one_box(backend, first, second))


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


HOG = "chunks = []\nwhile True:\n    chunks.append(b'x' * (16 << 20))\n"


FILL = "for d in /work /tmp /dev/shm; do dd if=/dev/zero of=$d/fill bs=1M count=1024 2>&1; done"


def test_filling_every_writable_mount_ends_in_enospc_and_the_agent_lives(backend: str) -> None:
    """/work, /tmp and /dev/shm filled together, at the default sizes and memory limit: each write
    ends with ENOSPC (the mounts leave the agent its reserve), the agent answers, and a command that
    then asks for memory is the one OOM-killed, reported as such: the tool's failure, not the box's."""
    async def body() -> None:
        async with pool_of(backend, memory_mb=512) as pool, pool.acquire() as sb:
            r = await sb.exec(FILL, timeout=60)
            assert r.stdout.count("No space left on device") == 3, r
            sizes = await sb.exec("du -sm /work/fill /tmp/fill /dev/shm/fill")
            assert sum(int(line.split()[0]) for line in sizes.stdout.splitlines()) >= 400, sizes
            assert (await sb.exec("echo alive")).stdout == "alive\n"
            r = await sb.exec(["python3", "-c", HOG], timeout=60)
            assert r.oom_killed and r.exit_code == 137 and not r.timed_out, r
            assert (await sb.exec("echo alive")).stdout == "alive\n"
    run(body())
    assert host_is_healthy()


def test_a_policy_that_exhausts_its_box_gets_a_failed_tool_call_and_a_scored_episode(backend: str) -> None:
    """The fill and the memory hog as a policy's own tool calls in a ``shell`` episode: each call's
    result says what happened (ENOSPC three times, the command killed for memory), the box lives on,
    and the episode plays to its end and is scored like any other (the policy cleans up and solves
    the task: reward 1.0). Never an infrastructure failure that would drop the group and excuse it."""
    from agentrl.errors import INFRASTRUCTURE
    from agentrl.rollout.episode import run_episode
    from tests.scripted_shell import TASK, GatedRouter, _bash

    script = [_bash(FILL), _bash(f"python3 -c {shlex.quote(HOG)}"),
              _bash("rm -f /work/fill /tmp/fill /dev/shm/fill; grep -c ERROR logs/app.log > errors.txt"),
              {"role": "assistant", "content": "done"}]

    class Router(GatedRouter):
        seen: list[dict[str, Any]] = []  # the messages of the episode's last call

        async def chat(self, body: dict[str, Any], session_id: str) -> dict[str, Any]:
            self.seen = body["messages"]
            return await super().chat(body, session_id)

    async def body() -> None:
        async with pool_of(backend, memory_mb=512) as pool:
            router = Router(script=script)
            ep = await run_episode(router, "shell", TASK, group_id="g", sandbox_pool=pool,
                                   env_config={"timeout_s": 60})
            assert ep.error is None and ep.error_kind not in INFRASTRUCTURE, ep.error
            assert ep.terminated and ep.reward == 1.0 and ep.info["tool_calls"] == 3, ep
            fill, hog, solve = (m["content"] for m in router.seen if m["role"] == "tool")
            assert fill.count("No space left on device") == 3, fill
            assert hog.startswith("exit 137 (killed: out of memory)"), hog
            assert solve == "exit 0", solve
            assert pool.stats()["oom_kills"] == 1, pool.stats()
    run(body())
    assert host_is_healthy()


def test_an_oom_kill_of_a_child_under_sh_is_reported(backend: str) -> None:
    async def body() -> None:
        async with pool_of(backend, memory_mb=128) as pool, pool.acquire() as sb:
            await sb.write_file("/work/hog.py", HOG)
            r = await sb.exec("python3 /work/hog.py; echo child=$?", timeout=60)
            assert r.stdout == "child=137\n" and r.exit_code == 0, r
            assert r.oom_killed and not r.ok, r
            r = await sb.exec("kill -9 $$")  # a SIGKILL that is not the OOM killer's
            assert r.exit_code == 137 and not r.oom_killed, r
            assert pool.stats()["oom_kills"] == 1
    run(body())
