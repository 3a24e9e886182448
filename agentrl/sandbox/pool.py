"""`SandboxPool`: warm pools, concurrency limit, reuse-after-reset, and leak-proof cleanup.

Role: the one object the rest of agentrl holds. It keeps `warm` sandboxes started ahead of demand,
hands one to each `acquire()` (never more than `max_concurrency` at once), and when an episode ends
either resets its sandbox (processes killed, SysV IPC removed, every writable mount emptied,
verified by the agent) for the next episode or replaces it.

Invariants:
- A sandbox goes back to the pool only after a successful reset of a clean episode (no timeout, no
  call cancelled mid-flight, no infrastructure error, under `max_reuses` uses); otherwise it is
  destroyed. Handles never outlive their episode (see handle.py).
- Release work is scheduled synchronously in the `finally` of `acquire()`, so a cancelled episode
  cannot skip it; the pool's background tasks do the awaiting.
- `close()` runs shielded to completion and then removes every sandbox of this instance by label,
  remembered or not; an at-exit hook does the same synchronously if `close()` never ran.
- A failed creation fails a waiting `acquire()` with SandboxError instead of leaving it hanging.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import secrets
import shutil
import socket
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.sandbox.backend import SandboxBackend, Slot
from agentrl.sandbox.handle import Sandbox
from agentrl.sandbox.stats import PoolStats
from agentrl.sandbox.types import SandboxConfig, SandboxError

if TYPE_CHECKING:
    from collections.abc import Coroutine

log = logging.getLogger(__name__)
T = TypeVar("T")


class SandboxPool:
    """Sandboxes for one serve process. `instance_id` must be unique among live processes that share
    a Docker engine; containers are labelled with it (default: host, pid and a random suffix)."""

    def __init__(self, cfg: SandboxConfig | None = None, instance_id: str | None = None) -> None:
        self.cfg = cfg or SandboxConfig()
        self.instance_id = (
            instance_id or f"agentrl-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        )
        self.backend: SandboxBackend | None = None
        self._stats = PoolStats()
        self._idle: list[Slot] = []
        self._waiters: deque[asyncio.Future[Slot]] = deque()
        self._creating = 0
        self._in_use: dict[str, Sandbox] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sem: asyncio.Semaphore | None = None
        self._closed = False
        self._shutdown_task: asyncio.Future[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Pick the backend, remove what dead instances left behind, fill the warm pool."""
        if self.backend is not None:
            return
        self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        backend = await self._pick_backend()
        self._stats.reaped = await backend.start()
        self.backend = backend
        atexit.register(self._atexit)
        fills = self._pump()
        results = await asyncio.gather(*fills, return_exceptions=True)
        if self.cfg.warm and len(self._idle) == 0:
            errors = [r for r in results if isinstance(r, BaseException)]
            raise SandboxError(f"no sandbox could be started on the {backend.name} backend: {errors[:1]}")
        log.info("sandbox pool %s started on %s: %d warm, %d stale removed",
                 self.instance_id, backend.name, len(self._idle), self._stats.reaped)

    async def _pick_backend(self) -> SandboxBackend:
        from agentrl.sandbox.bwrap_backend import BubblewrapBackend
        from agentrl.sandbox.docker_backend import DockerBackend

        if self.cfg.docker_hosts:  # several engines: the hosts layer places and takes out (hosts.py)
            from agentrl.sandbox.hosts import DockerHosts

            return DockerHosts(self.cfg, self.instance_id)
        if self.cfg.backend == "docker":
            return DockerBackend(self.cfg, self.instance_id)
        if self.cfg.backend == "bubblewrap":
            return BubblewrapBackend(self.cfg, self.instance_id)
        docker = DockerBackend(self.cfg, self.instance_id)
        try:
            await docker.api.ping()
            return docker
        except SandboxError as e:
            await docker.api.close()
            if shutil.which(self.cfg.bwrap_path):
                log.warning("no Docker engine (%s); using bubblewrap, which isolates less", e)
                return BubblewrapBackend(self.cfg, self.instance_id)
            raise SandboxError(f"no sandbox backend: Docker unreachable ({e}) and {self.cfg.bwrap_path!r} "
                               "not installed (apt-get install bubblewrap)") from e

    async def close(self) -> None:
        """Remove every sandbox of this instance. Completes even if the caller is cancelled; a
        later call waits for that same shutdown to finish."""
        if self._shutdown_task is None:
            self._closed = True
            self._shutdown_task = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(SandboxError("sandbox pool closed"))
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sb in list(self._in_use.values()):
            sb.released = True
        slots = self._idle + [sb._slot for sb in self._in_use.values()]
        self._idle.clear()
        if self.backend is None:
            return
        for slot in slots:
            await slot.channel.aclose()
        removed = await self.backend.close()
        self._stats.destroyed += removed
        atexit.unregister(self._atexit)
        log.info("sandbox pool %s closed: %d sandboxes removed", self.instance_id, removed)

    def _atexit(self) -> None:
        if self.backend is not None and not self._closed:
            try:
                n = self.backend.close_sync()
                log.warning(
                    "sandbox pool %s was not closed; at-exit removed %d sandboxes", self.instance_id, n
                )
            except Exception:
                log.exception("at-exit sandbox cleanup failed")

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- acquire / release ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Sandbox]:
        """A clean sandbox for one episode; released (reset or replaced) when the block exits,
        however it exits."""
        if self.backend is None or self._sem is None:
            raise SandboxError("SandboxPool.start() has not been awaited")
        if self._closed:
            raise SandboxError("sandbox pool is closed")
        t0 = time.perf_counter()
        await self._sem.acquire()
        try:
            slot = await self._take()
        except BaseException:
            self._sem.release()
            raise
        sb = Sandbox(slot, self.backend.name, self.cfg, self._stats)
        self._in_use[slot.id] = sb
        self._stats.acquires += 1
        self._stats.acquire_s.append(time.perf_counter() - t0)
        try:
            yield sb
        finally:
            self._release(sb)  # synchronous on purpose: a second cancellation cannot interrupt it

    async def _take(self) -> Slot:
        while self._idle:
            slot = self._idle.pop()  # LIFO: the most recently used box is the warmest
            if slot.channel.closed:
                self._spawn(self._destroy(slot))
                continue
            self._stats.warm_hits += 1
            self._pump()
            return slot
        fut: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._pump()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._offer(fut.result())  # a box arrived just as we were cancelled: keep it
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def _release(self, sb: Sandbox) -> None:
        sb.released = True
        self._in_use.pop(sb.id, None)
        slot = sb._slot
        if self._closed:
            reason: str | None = "pool closed"
        elif sb.taint:
            reason = sb.taint
        elif sb.inflight:
            reason = "call in flight"
        elif slot.channel.closed:
            reason = "agent gone"
        elif slot.uses >= self.cfg.max_reuses:
            reason = "reuse limit"
        else:
            reason = None
        if self._closed:
            self._sem.release()  # type: ignore[union-attr]
            return  # _shutdown removes it
        self._spawn(self._recycle(slot, reason))

    async def _recycle(self, slot: Slot, reason: str | None) -> None:
        try:
            if reason is None:
                try:
                    answer = await slot.channel.call("reset", 30.0)
                except SandboxError as e:
                    answer = {"ok": False, "left": [str(e)]}
                if answer.get("ok"):
                    slot.uses += 1
                    self._stats.resets += 1
                    self._offer(slot, recycled=True)
                    return
                # What the agent could not remove (a process, an IPC object, a file): the box
                # is not handed on, and the log says what an episode managed to leave behind.
                reason = f"reset failed, left: {answer.get('left')}"
                log.warning("sandbox %s %s", slot.id[:12], reason)
            log.debug("replacing sandbox %s: %s", slot.id[:12], reason)
            await self._destroy(slot)
        finally:
            self._sem.release()  # type: ignore[union-attr]
            self._pump()

    # --- supply ----------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # failures are logged already
        return task

    def _pump(self) -> list[asyncio.Task[Any]]:
        """Start creations until idle + creating covers the warm target plus every waiter."""
        if self._closed or self.backend is None:
            return []
        need = self.cfg.warm + len(self._waiters) - len(self._idle) - self._creating
        tasks = []
        for _ in range(max(0, need)):
            self._creating += 1
            tasks.append(self._spawn(self._create_one()))
        return tasks

    async def _create_one(self) -> Slot:
        assert self.backend is not None
        t0 = time.perf_counter()
        try:
            slot = await self.backend.create()
        except SandboxError as e:
            self._stats.infra_errors += 1
            log.warning("sandbox creation failed: %s", e)
            while self._waiters:  # fail one waiter: loud and bounded, never a silent hang
                w = self._waiters.popleft()
                if not w.done():
                    w.set_exception(e)
                    break
            raise
        finally:
            self._creating -= 1
        self._stats.created += 1
        self._stats.create_s.append(time.perf_counter() - t0)
        self._offer(slot)
        return slot

    def _offer(self, slot: Slot, recycled: bool = False) -> None:
        if self._closed:
            self._spawn(self._destroy(slot))
            return
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(slot)
                return
        if len(self._idle) < self.cfg.warm + self.cfg.max_concurrency:
            # Reset boxes go on top (taken first: their caches are warm), fresh ones at the bottom.
            self._idle.insert(len(self._idle) if recycled else 0, slot)
        else:
            self._spawn(self._destroy(slot))

    async def _destroy(self, slot: Slot) -> None:
        assert self.backend is not None
        try:
            await self.backend.destroy(slot)
            self._stats.destroyed += 1
        except SandboxError as e:
            self._stats.infra_errors += 1
            log.warning("could not destroy sandbox %s: %s", slot.id[:12], e)

    # --- introspection ---------------------------------------------------------------------------

    async def wait_idle(self, timeout: float = 120.0) -> None:
        """Wait until no creation, reset or removal is in flight (tests, benchmarks, draining)."""
        deadline = time.monotonic() + timeout
        while self._tasks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxError(f"sandbox pool still busy after {timeout:.0f}s: {len(self._tasks)} tasks")
            await asyncio.wait(set(self._tasks), timeout=left)

    def stats(self) -> dict[str, Any]:
        """warm, in_use, creating, created, destroyed, resets, exec counts and latencies, errors."""
        return {
            "backend": self.backend.name if self.backend else None,
            "warm": len(self._idle),
            "in_use": len(self._in_use),
            "creating": self._creating,
            **self._stats.as_dict(),
            **(self.backend.stats() if self.backend else {}),
        }

    async def live_ids(self) -> list[str]:
        """Ids of this instance's sandboxes that exist right now (asks the backend, not memory)."""
        return await self.backend.live_ids() if self.backend else []
