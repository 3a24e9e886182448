"""Bubblewrap backend: one `bwrap` process tree per sandbox, for machines without a Docker engine.

Weaker isolation than Docker, and documented as such: the sandbox shares the host kernel like a
container does, but sees the host's /usr read-only (no image of its own), runs in unprivileged
user/pid/net/ipc/uts/cgroup namespaces set up by bwrap rather than by a container runtime, and has
no seccomp filter. Limits come from a cgroup per sandbox (v1 or v2) when this process may create
cgroups; otherwise only from rlimits (address space; process count when not root), which a
determined program can partly evade (e.g. many processes each under the address-space limit).

Invariants:
- bwrap never runs as host root. A root owner (CI, containers) starts it as the host uid:gid of
  `sandbox.user` (nobody by default), after joining the sandbox's cgroups; bwrap then maps the
  sandbox user to that uid. (Run by root, bwrap maps it to host uid 0, and every root-owned file
  the kernel checks by uid, /proc/sys/kernel/core_pattern among them, becomes writable.)
- /proc/sys and /dev are read-only; /dev/shm and /dev/mqueue are the sandbox's own mounts, which
  the agent empties at reset. Nested user namespaces are refused (`--disable-userns`).
- The agent is pid 1 (`--as-pid-1`): no bwrap init holds its stdin/stdout (see execd.py).
- `--die-with-parent`: if the owning process dies, every sandbox it started dies with it.
- Each sandbox's cgroup lives under `agentrl/<owner pid>.<owner start ticks>/`, so a later process
  can find and remove what a dead owner left (`reap_stale`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import secrets
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

from agentrl.sandbox.backend import SandboxBackend, Slot, process_start_ticks
from agentrl.sandbox.channel import ExecChannel, execd_source
from agentrl.sandbox.types import SandboxConfig, SandboxError

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")


class Cgroups:
    """Per-sandbox cgroups under <root>/agentrl/<owner>/<sandbox>, on cgroup v1 or v2."""

    def __init__(self, owner: str) -> None:
        self.v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
        self.owner = owner
        self.bases = (
            [CGROUP_ROOT / "agentrl"] if self.v2 else [CGROUP_ROOT / c / "agentrl" for c in V1_CONTROLLERS]
        )

    def usable(self) -> bool:
        try:
            for base in self.bases:
                _mkdir_open(base, base / self.owner)
            if self.v2:
                with contextlib.suppress(OSError):
                    (self.bases[0] / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            return True
        except OSError:
            return False

    def dirs(self, sid: str, owner: str | None = None) -> list[Path]:
        return [base / (owner or self.owner) / sid for base in self.bases]

    def create(self, sid: str, cfg: SandboxConfig) -> tuple[list[Path], Path]:
        """Make the cgroups; returns (their cgroup.procs files, the file counting OOM kills)."""
        mem = str(cfg.memory_mb * 2**20)
        dirs = self.dirs(sid)
        for base, d in zip(self.bases, dirs, strict=True):
            _mkdir_open(base, d)
        if self.v2:
            (d,) = dirs
            if self.owner and (d.parent / "cgroup.subtree_control").exists():
                with contextlib.suppress(OSError):
                    (d.parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
            _write(d / "memory.max", mem)
            _write(d / "memory.swap.max", "0", optional=True)
            _write(d / "pids.max", str(cfg.pids))
            _write(d / "cpu.max", f"{int(cfg.cpus * 100000)} 100000", optional=True)
            return [d / "cgroup.procs"], d / "memory.events"
        memd, pidsd, cpud = dirs
        _write(memd / "memory.limit_in_bytes", mem)
        _write(memd / "memory.memsw.limit_in_bytes", mem, optional=True)
        _write(pidsd / "pids.max", str(cfg.pids))
        _write(cpud / "cpu.cfs_period_us", "100000", optional=True)
        _write(cpud / "cpu.cfs_quota_us", str(int(cfg.cpus * 100000)), optional=True)
        return [d / "cgroup.procs" for d in dirs], memd / "memory.oom_control"

    def remove(self, dirs: list[Path]) -> None:
        for _ in range(100):
            for d in dirs:
                for pid in _pids_in(d):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(FileNotFoundError, OSError):
                    d.rmdir()
            if not any(d.exists() for d in dirs):
                return
            time.sleep(0.01)
        log.warning("could not remove cgroups %s", dirs)

    def owners(self) -> list[str]:
        base = self.bases[0]
        return [p.name for p in base.iterdir() if p.is_dir()] if base.exists() else []

    def sandboxes(self, owner: str) -> list[str]:
        d = self.bases[0] / owner
        return [p.name for p in d.iterdir() if p.is_dir()] if d.exists() else []

    def remove_owner(self, owner: str) -> int:
        sids = self.sandboxes(owner)
        for sid in sids:
            self.remove(self.dirs(sid, owner))
        for base in self.bases:
            with contextlib.suppress(OSError):
                (base / owner).rmdir()
        return len(sids)


def _user_ids(user: str) -> tuple[int, int]:
    """(uid, gid) from a `sandbox.user` value "uid:gid" (gid defaults to uid)."""
    uid, _, gid = user.partition(":")
    try:
        return int(uid or 65534), int(gid or uid or 65534)
    except ValueError:
        raise SandboxError(
            f"sandbox.user={user!r}: bubblewrap needs numeric uid:gid, e.g. 65534:65534"
        ) from None


def _mkdir_open(base: Path, d: Path) -> None:
    """``d`` (``base`` or a folder under it) made with its parents, and each folder from ``base``
    down set to 0755 whatever the umask (serve's is 077, and a base made by an older run may be
    0700): bwrap runs as an unprivileged user, which must reach the OOM counter bound into the box."""
    d.mkdir(parents=True, exist_ok=True)
    for folder in (d, *(base / up for up in d.relative_to(base).parents)):
        folder.chmod(0o755)


def _write(path: Path, value: str, optional: bool = False) -> None:
    try:
        path.write_text(value)
    except OSError:
        if not optional:
            raise


def _pids_in(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _owner_alive(owner: str) -> bool:
    pid, _, ticks = owner.partition(".")
    return pid.isdigit() and os.path.exists(f"/proc/{pid}") and process_start_ticks(int(pid)) == ticks


class BubblewrapBackend(SandboxBackend):
    name = "bubblewrap"

    def __init__(self, cfg: SandboxConfig, instance_id: str) -> None:
        super().__init__(cfg, instance_id)
        pid = os.getpid()
        self._cg = Cgroups(f"{pid}.{process_start_ticks(pid)}")
        self._use_cg = False
        self._host_ids: tuple[int, int] | None = None
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._create_sem = asyncio.Semaphore(cfg.create_concurrency)
        self._python = (
            "/usr/bin/python3"
            if os.path.exists("/usr/bin/python3")
            else (shutil.which("python3") or "python3")
        )

    async def start(self) -> int:
        if not shutil.which(self.cfg.bwrap_path):
            raise SandboxError(f"{self.cfg.bwrap_path!r} not found; apt-get install bubblewrap")
        self._host_ids = self.host_ids()
        reaped = self.reap_stale()
        self._use_cg = self._cg.usable()
        if not self._use_cg:
            log.warning("cannot create cgroups under %s: bubblewrap sandboxes get rlimits only "
                        "(memory as address space; no pids limit when running as root)", CGROUP_ROOT)
        return reaped

    def reap_stale(self) -> int:
        """Remove the cgroups (and kill the processes) of owners that are gone."""
        n = 0
        with contextlib.suppress(OSError):
            for owner in self._cg.owners():
                if owner != self._cg.owner and not _owner_alive(owner):
                    n += self._cg.remove_owner(owner)
        return n

    def host_ids(self) -> tuple[int, int] | None:
        """The unprivileged host (uid, gid) bwrap runs as when we are root; None when we are not
        (bwrap then runs as us, an unprivileged user already)."""
        if os.geteuid() != 0:
            return None
        uid, gid = _user_ids(self.cfg.user)
        if uid == 0 or gid == 0:
            raise SandboxError(f"sandbox.user={self.cfg.user!r}: bubblewrap sandboxes never run as host root "
                               "(uid and gid 0); use an unprivileged uid:gid such as 65534:65534")
        return uid, gid

    def _argv(self, oom_file: Path | None) -> list[str]:
        cfg = self.cfg
        size = {path: str(mb * 2**20) for path, mb in cfg.mount_sizes_mb().items()}
        uid, gid = _user_ids(cfg.user)
        argv = [cfg.bwrap_path, "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1",
                "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--uid", str(uid), "--gid", str(gid), "--hostname", "sandbox",
                "--ro-bind", "/usr", "/usr"]
        for top in ("bin", "lib", "lib64", "sbin", "lib32"):
            host = Path("/") / top
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{top}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{top}"]
        for f in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime", "/etc/passwd", "/etc/group"):
            argv += ["--ro-bind-try", f, f]
        # A sysctl file shows the namespaces of whoever reads it, whichever proc mount it is
        # reached through, so binding the host's /proc/sys read-only over ours shows the same values.
        argv += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys",
                 "--dev", "/dev", "--size", size["/dev/shm"], "--tmpfs", "/dev/shm",
                 "--mqueue", "/dev/mqueue",
                 "--remount-ro", "/dev",  # not recursive: /dev/shm, /dev/mqueue and the device nodes stay
                 "--size", size["/work"], "--tmpfs", "/work", "--size", size["/tmp"], "--tmpfs", "/tmp",
                 "--chdir", "/work", "--clearenv",
                 "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/work",
                 "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
        if oom_file is not None:
            argv += [
                "--ro-bind",
                str(oom_file),
                "/run/agentrl/oom",
                "--setenv",
                "AGENTRL_OOM_FILE",
                "/run/agentrl/oom",
            ]
        argv += ["--remount-ro", "/"]  # bwrap's root tmpfs would otherwise be writable (and ours)
        return [*argv, "--", self._python, "-u", "-I", "-c", execd_source()]

    async def create(self) -> Slot:
        async with self._create_sem:
            sid = f"bwrap-{secrets.token_hex(6)}"
            procs_files: list[Path] = []
            oom_file = None
            if self._use_cg:
                procs_files, oom_file = self._cg.create(sid, self.cfg)
            mem_bytes, pids = self.cfg.memory_mb * 2**20, self.cfg.pids
            # RLIMIT_NPROC counts every process of the host uid, so it is only set for an owner that
            # is not root (a root owner's sandboxes share nobody with whatever else runs as nobody).
            host_ids, nproc = self._host_ids, os.getuid() != 0

            def enter_limits() -> None:  # runs in the child between fork and exec
                for f in procs_files:  # while still root: joining a cgroup needs it
                    with open(f, "w") as fh:
                        fh.write(str(os.getpid()))
                if not procs_files:
                    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
                    if nproc:
                        resource.setrlimit(resource.RLIMIT_NPROC, (pids, pids))
                if host_ids is not None:  # last: from here on nothing of root's is left to us
                    os.setgroups([])
                    os.setresgid(host_ids[1], host_ids[1], host_ids[1])
                    os.setresuid(host_ids[0], host_ids[0], host_ids[0])

            try:
                proc = await asyncio.create_subprocess_exec(
                    *self._argv(oom_file), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, preexec_fn=enter_limits, cwd="/")
            except OSError as e:
                self._cg.remove(self._cg.dirs(sid)) if self._use_cg else None
                raise SandboxError(f"could not start bwrap: {e}") from e
            self._procs[sid] = proc
            assert proc.stdout is not None and proc.stdin is not None
            channel = ExecChannel(_chunks(proc.stdout), proc.stdin, sid)
            try:
                await channel.wait_ready(self.cfg.start_timeout_s)
            except BaseException as e:
                err = b""
                with contextlib.suppress(Exception):
                    assert proc.stderr is not None
                    err = await asyncio.wait_for(proc.stderr.read(4096), 0.5)
                await asyncio.shield(self._kill(sid))
                if isinstance(e, SandboxError):
                    raise SandboxError(f"{e}; bwrap said: {err.decode(errors='replace').strip()}") from e
                raise
            return Slot(sid, channel)

    async def _kill(self, sid: str) -> None:
        proc = self._procs.pop(sid, None)
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 10)
        if self._use_cg:
            await asyncio.to_thread(self._cg.remove, self._cg.dirs(sid))

    async def destroy(self, slot: Slot) -> None:
        await slot.channel.aclose()
        await self._kill(slot.id)

    async def close(self) -> int:
        sids = list(self._procs)
        await asyncio.gather(*(self._kill(sid) for sid in sids))
        if self._use_cg:
            await asyncio.to_thread(self._cg.remove_owner, self._cg.owner)
        return len(sids)

    def close_sync(self) -> int:
        sids = list(self._procs)
        for proc in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        self._procs.clear()
        if self._use_cg:
            self._cg.remove_owner(self._cg.owner)
        return len(sids)

    async def live_ids(self) -> list[str]:
        ids = {sid for sid, p in self._procs.items() if p.returncode is None}
        if self._use_cg:
            ids |= {
                sid
                for sid in self._cg.sandboxes(self._cg.owner)
                if any(_pids_in(d) for d in self._cg.dirs(sid))
            }
        return sorted(ids)


async def _chunks(stream: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        data = await stream.read(65536)
        if not data:
            return
        yield data
