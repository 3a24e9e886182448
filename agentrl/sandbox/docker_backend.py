"""Docker backend: one locked-down container per sandbox, driven through the engine's HTTP API.

Each container runs the exec agent as its pid 1 (no `--init`: an init would hold the container's
stdin/stdout, which any command of the same uid could open through /proc/1/fd and use to forge or
steal the agent's messages), attached to our end of a hijacked API connection (stdin/stdout). The
agent reaps orphans itself. Isolation: no network, read-only root and /proc/sys, tmpfs /work and
/tmp, memory with swap equal, CPU quota, pids limit, uid nobody, every capability dropped,
no-new-privileges, private IPC, no host mounts, no logs kept by the engine.

Invariants:
- Every container carries `agentrl.*` owner labels (instance id, pid and its start time, host,
  boot id), so any later process can tell whether its owner is alive.
- Stdin closes when our connection does (StdinOnce) and containers are AutoRemove: if the owning
  process dies, its agents read EOF, exit, and the engine removes their containers by itself;
  `reap_stale` on the next start removes whatever is left (a command that ignored the agent's
  death kept nothing alive: the kernel kills a pid namespace when its pid 1, the agent, exits).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.sandbox.backend import SandboxBackend, Slot, owner_is_dead, owner_labels
from agentrl.sandbox.channel import ExecChannel, execd_source
from agentrl.sandbox.docker_api import DockerAPI, remove_by_label
from agentrl.sandbox.types import SandboxConfig, SandboxError

if TYPE_CHECKING:
    from collections.abc import Coroutine

log = logging.getLogger(__name__)
T = TypeVar("T")

READONLY_PROC_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")


def _tracked(coro: Coroutine[Any, Any, T], into: set[asyncio.Future[Any]]) -> asyncio.Future[T]:
    """``coro`` as a future held in ``into`` until it is done (close() waits for what is there)."""
    fut = asyncio.ensure_future(coro)
    into.add(fut)
    fut.add_done_callback(into.discard)
    return fut


class DockerBackend(SandboxBackend):
    name = "docker"

    def __init__(self, cfg: SandboxConfig, instance_id: str) -> None:
        super().__init__(cfg, instance_id)
        self.api = DockerAPI(cfg.resolved_docker_host(), timeout=cfg.api_timeout_s)
        self._create_sem = asyncio.Semaphore(cfg.create_concurrency)
        self._labels = {**cfg.labels, **owner_labels(instance_id)}
        self._creating: set[asyncio.Future[str]] = set()
        self._removing: set[asyncio.Future[None]] = set()  # removals a cancelled creator left running
        self._closed = False

    def container_spec(self) -> dict:
        cfg = self.cfg
        mem = cfg.memory_mb * 2**20
        # (Docker 20.10 drops `mode` when nosuid/nodev are listed; it adds them by itself.)
        mounts = cfg.mount_sizes_mb()
        return {
            "Image": cfg.image,
            "Cmd": ["python3", "-u", "-I", "-c", execd_source()],
            "User": cfg.user,
            # No WorkingDir: with it, Docker re-creates /work as root 0755 over the tmpfs mode.
            # The agent chdirs to /work itself.
            "Env": ["HOME=/work", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1",
                    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "Labels": self._labels,
            "AttachStdin": True, "AttachStdout": True, "AttachStderr": True,
            "OpenStdin": True, "StdinOnce": True, "Tty": False,
            "NetworkDisabled": True,
            "HostConfig": {
                "NetworkMode": "none",
                "ReadonlyRootfs": True,
                # The engine's default, stated so that it cannot silently go: no sysctl is writable.
                "ReadonlyPaths": list(READONLY_PROC_PATHS),
                "Tmpfs": {path: f"rw,exec,size={mounts[path]}m,mode=1777" for path in ("/work", "/tmp")},
                "Memory": mem, "MemorySwap": mem,
                "NanoCpus": int(cfg.cpus * 1e9),
                "PidsLimit": cfg.pids,
                "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges"],
                "Init": False,  # the agent is pid 1 (see the module docstring)
                "AutoRemove": True,
                "IpcMode": "private",
                "ShmSize": mounts["/dev/shm"] * 2**20,
                "LogConfig": {"Type": "none", "Config": {}},
                "Ulimits": [{"Name": "nofile", "Soft": 4096, "Hard": 4096}],
            },
        }

    async def start(self) -> int:
        await self.api.ping()
        if not await self.api.image_exists(self.cfg.image):
            raise SandboxError(
                f"sandbox image {self.cfg.image!r} is not built on the Docker engine at {self.api.host}; "
                "run `agentrl sandbox build` (or agentrl.sandbox.build_images())")
        return await self.reap_stale()

    async def reap_stale(self) -> int:
        """Remove containers of dead owners, and any of our own instance id left by a predecessor
        (swept until the engine lists none of them, as in :meth:`close`)."""
        async def stale() -> list[str]:
            return [c["Id"] for c in await self.api.list(["agentrl.sandbox"])
                    if (c.get("Labels") or {}).get("agentrl.instance") == self.instance_id
                    or owner_is_dead(c.get("Labels") or {})]

        removed = await self._remove_until_unlisted(stale, "of dead owners ")
        if removed:
            log.info("removed %d sandbox containers left by dead owners", removed)
        return removed

    async def _remove_until_unlisted(self, listed: Callable[[], Awaitable[list[str]]], what: str = "") -> int:
        """Remove what ``listed()`` names until it names nothing, for at most ``api_timeout_s``; how
        many were removed. A container whose removal is already under way (ours, or Docker's
        AutoRemove once its dead owner's attach closed) answers 409 and stays listed for a moment."""
        removed: set[str] = set()
        deadline = time.monotonic() + self.cfg.api_timeout_s
        while ids := await listed():
            if time.monotonic() > deadline:
                log.warning("%d sandbox containers %sstill listed after %.0f s of removing them: %s",
                            len(ids), what, self.cfg.api_timeout_s, ", ".join(i[:12] for i in ids))
                break
            await asyncio.gather(*(self.api.remove(cid) for cid in ids))  # 404 and 409 count as done
            removed.update(ids)
            await asyncio.sleep(0.05)
        return len(removed)

    async def create(self) -> Slot:
        async with self._create_sem:
            t0 = time.monotonic()
            # Shielded: if we are cancelled while the engine is creating, the container still
            # appears; close() waits for these calls so that its sweep by label sees it.
            cid = await asyncio.shield(_tracked(self.api.create(self.container_spec()), self._creating))
            try:
                chunks, writer = await self.api.attach(cid)
                channel = ExecChannel(chunks, writer, cid[:12])
                await self.api.start(cid)
                await channel.wait_ready(self.cfg.start_timeout_s)
            except BaseException:
                # Shielded: a cancelled creator must not leave the container behind; close()
                # waits for these too, so their requests are not cut off when it closes the client.
                await asyncio.shield(_tracked(self._remove_quietly(cid), self._removing))
                raise
            log.debug("sandbox %s ready in %.0f ms", cid[:12], (time.monotonic() - t0) * 1e3)
            return Slot(cid, channel)

    async def _remove_quietly(self, cid: str) -> None:
        try:
            await self.api.remove(cid)
        except SandboxError as e:
            log.warning("could not remove sandbox %s: %s", cid[:12], e)

    async def destroy(self, slot: Slot) -> None:
        await slot.channel.aclose()
        await self.api.remove(slot.id)

    async def close(self) -> int:
        """Remove every container of this instance; returns how many were removed.

        Waits for creations and removals still in flight, then sweeps by label until the engine
        lists none (a container whose removal is already in progress, ours or AutoRemove's,
        answers 409 and is still listed for a moment), for at most ``api_timeout_s``.
        """
        self._closed = True
        try:
            await asyncio.gather(*self._creating, *self._removing, return_exceptions=True)
            return await self._remove_until_unlisted(self._listed_ids)
        finally:
            await self.api.close()

    def close_sync(self) -> int:
        return remove_by_label(self.api.host, f"agentrl.instance={self.instance_id}")

    async def _listed_ids(self) -> list[str]:
        return [c["Id"] for c in await self.api.list([f"agentrl.instance={self.instance_id}"])]

    async def live_ids(self) -> list[str]:
        try:
            return await self._listed_ids()
        finally:
            if self._closed:  # asked after close(): do not leave a client session open
                await self.api.close()
