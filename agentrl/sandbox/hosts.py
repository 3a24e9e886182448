"""Several Docker engines as one sandbox backend: placement by load, and a host that stops answering
taken out, its sandboxes failed, and probed until it answers again.

Role: with ``sandbox.docker_hosts`` the pool's backend is a :class:`DockerHosts`, one
:class:`~agentrl.sandbox.docker_backend.DockerBackend` (with its own API client) per engine behind
the one backend interface, so the pool above it neither knows nor branches on how many engines
there are.

Invariants:
- A new sandbox goes to the answering host with the fewest live sandboxes (made and not yet
  destroyed, plus those being made); on a tie, the earlier host in the list.
- A host is taken out when a call to its engine fails at the transport level (SandboxHostDown:
  refused, reset, no socket, timed out) or one of its sandboxes' streams ends by itself, and the
  engine then answers neither of two pings. Taking out is logged once, fails every sandbox that lived
  on the host with SandboxHostDown (an infrastructure failure: their episodes are recorded as
  ``sandbox`` failures, not scored) and forgets them; a creation that met the dead host tries the
  next one, so an acquire fails only when no host answers.
- A host that is out is probed after a backoff (1 s, doubling up to 30 s). Once it answers, what
  this instance left there is removed, a missing image is copied from a host that has it, and it
  takes sandboxes again. While it is out nothing is placed on it, and nothing of it is remembered.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.sandbox.backend import SandboxBackend, Slot
from agentrl.sandbox.docker_backend import DockerBackend
from agentrl.sandbox.types import SandboxConfig, SandboxError, SandboxHostDown

if TYPE_CHECKING:
    from collections.abc import Coroutine

log = logging.getLogger(__name__)

PROBE_BACKOFF_S = (1.0, 30.0)  # first wait before probing a host that is out, and the longest
PING_TIMEOUT_S = 10.0  # a ping (after a lost stream, or a probe) that takes longer counts as no answer


@dataclass(eq=False)
class DockerHost:
    """One engine of ``sandbox.docker_hosts`` and the sandboxes this instance has on it."""

    address: str
    backend: DockerBackend
    sandboxes: dict[str, Slot] = field(default_factory=dict)
    creating: int = 0
    down: str | None = None  # why it was taken out; None while it takes sandboxes

    @property
    def load(self) -> int:
        return len(self.sandboxes) + self.creating


class DockerHosts(SandboxBackend):
    """The Docker backend over every engine of ``cfg.docker_hosts`` (see the module docstring)."""

    name = "docker"

    def __init__(self, cfg: SandboxConfig, instance_id: str,
                 probe_backoff_s: tuple[float, float] | None = None) -> None:
        super().__init__(cfg, instance_id)
        self.hosts = [DockerHost(address, DockerBackend(
            dataclasses.replace(cfg, docker_host=address, docker_hosts=[]), instance_id))
            for address in cfg.docker_hosts]
        self.probe_backoff_s = probe_backoff_s or PROBE_BACKOFF_S
        self._ping_timeout = min(PING_TIMEOUT_S, cfg.api_timeout_s)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._checking: set[DockerHost] = set()  # hosts being pinged after one of their streams ended
        self._closed = False

    # --- start and placement ---------------------------------------------------------------------

    async def start(self) -> int:
        """Ping every host, take out those that do not answer, make the others ready (image copied
        where missing, what dead owners left removed). Raises when no host answers."""
        try:
            pings = await asyncio.gather(*(self._ping(h) for h in self.hosts), return_exceptions=True)
            for host, answer in zip(self.hosts, pings, strict=True):
                if isinstance(answer, SandboxHostDown):
                    self._take_out(host, answer)
                elif isinstance(answer, BaseException):
                    raise answer
            removed = 0
            for host in self.hosts:
                if host.down is None:
                    try:
                        removed += await self._prepare(host)
                    except SandboxHostDown as e:
                        self._take_out(host, e)
            self._place(set())  # raises when none is left
        except BaseException:
            await self.close()  # no pool holds this backend: stop its probes and clients here
            raise
        return removed

    async def _ping(self, host: DockerHost) -> None:
        try:
            await asyncio.wait_for(host.backend.api.ping(), self._ping_timeout)
        except TimeoutError as e:
            raise SandboxHostDown(f"Docker engine at {host.address} did not answer a ping in "
                                  f"{self._ping_timeout:.0f} s") from e

    async def _answers(self, host: DockerHost) -> SandboxHostDown | None:
        """None when ``host``'s engine answers a ping, else why not. Tried twice, so that one stale
        pooled connection (reset) is not taken for a dead engine."""
        error = None
        for _ in range(2):
            try:
                await self._ping(host)
                return None
            except SandboxHostDown as e:
                error = e
            except SandboxError:  # it answered, with an error: it is up
                return None
        return error

    async def _prepare(self, host: DockerHost) -> int:
        """Make ``host`` ready to take sandboxes: the image there (copied from another host that has
        it), and what this instance or dead owners left on it removed. Returns how many removed."""
        image, api = self.cfg.image, host.backend.api
        if not await api.image_exists(image):
            source = None
            for other in self.hosts:
                if other is host or other.down is not None:
                    continue
                try:
                    if await other.backend.api.image_exists(image):
                        source = other
                        break
                except SandboxHostDown:
                    continue
            if source is None:
                raise SandboxError(f"sandbox image {image!r} is on no engine of sandbox.docker_hosts "
                                   "that answers; run `agentrl sandbox build` against one of them")
            log.info("copying sandbox image %s from the Docker engine at %s to the one at %s",
                     image, source.address, host.address)
            await source.backend.api.copy_image(image, api)
        return await host.backend.reap_stale()

    def _place(self, tried: set[DockerHost]) -> DockerHost:
        up = [h for h in self.hosts if h.down is None and h not in tried]
        if not up:
            why = "; ".join(f"{h.address}: {h.down or 'failed just now'}" for h in self.hosts)
            raise SandboxHostDown(f"no engine of sandbox.docker_hosts takes sandboxes ({why})")
        return min(up, key=lambda h: h.load)  # the first of the least loaded

    async def create(self) -> Slot:
        tried: set[DockerHost] = set()
        while True:
            host = self._place(tried)
            host.creating += 1
            failed: SandboxHostDown | None = None
            try:
                slot = await host.backend.create()
            except SandboxHostDown as e:
                failed = e
            finally:
                host.creating -= 1
            if failed is not None:
                if (why := await self._answers(host)) is None:
                    raise failed
                self._take_out(host, why)
                tried.add(host)
                continue
            if host.down is not None:  # taken out while this one was made: it does not stay there
                tried.add(host)
                with contextlib.suppress(SandboxError):
                    await host.backend.destroy(slot)
                continue
            host.sandboxes[slot.id] = slot
            slot.extra["docker_host"] = host.address
            slot.channel.on_close(lambda _reason, host=host, sid=slot.id: self._stream_ended(host, sid))
            return slot

    # --- a host that stops answering ------------------------------------------------------------

    def _stream_ended(self, host: DockerHost, sid: str) -> None:
        """A sandbox's stream ended by itself: its agent died, or its whole engine did. Ask the engine."""
        if self._closed or host.down is not None or sid not in host.sandboxes or host in self._checking:
            return
        self._checking.add(host)
        self._spawn(self._check(host))

    async def _check(self, host: DockerHost) -> None:
        try:
            if (why := await self._answers(host)) is not None:
                self._take_out(host, why)
        finally:
            self._checking.discard(host)

    def _take_out(self, host: DockerHost, error: SandboxError) -> None:
        if host.down is not None:
            return
        host.down = str(error)
        lost = list(host.sandboxes.values())
        host.sandboxes.clear()
        for slot in lost:
            slot.channel.lose(f"its Docker host {host.address} stopped answering", SandboxHostDown)
        left = [h.address for h in self.hosts if h.down is None]
        log.warning("Docker host %s stopped answering (%s): taken out of placement, %d sandboxes on it "
                    "failed; %s%s", host.address, error, len(lost),
                    f"placing on {', '.join(left)}" if left else "no host left to place on",
                    "" if self._closed else f"; probing it again in {self.probe_backoff_s[0]:g} s")
        if not self._closed:
            self._spawn(self._probe(host))

    async def _probe(self, host: DockerHost) -> None:
        delay, longest = self.probe_backoff_s
        while True:
            await asyncio.sleep(delay)
            try:
                await self._ping(host)
                removed = await self._prepare(host)
            except SandboxError as e:
                if not isinstance(e, SandboxHostDown):
                    log.warning("Docker host %s answers but cannot take sandboxes yet: %s", host.address, e)
                delay = min(delay * 2, longest)
                continue
            host.down = None
            log.warning("Docker host %s answers again: back in placement (%d sandboxes left there removed)",
                        host.address, removed)
            return

    # --- destroy, close, introspection -----------------------------------------------------------

    async def destroy(self, slot: Slot) -> None:
        host = next((h for h in self.hosts if slot.id in h.sandboxes), None)
        if host is None:  # its host was taken out: the container went with it, or goes when it is back
            await slot.channel.aclose()
            return
        del host.sandboxes[slot.id]
        await self._destroy_on(host, slot)

    async def _destroy_on(self, host: DockerHost, slot: Slot) -> None:
        try:
            await host.backend.destroy(slot)
        except SandboxHostDown:
            if (why := await self._answers(host)) is None:
                raise
            self._take_out(host, why)

    async def close(self) -> int:
        """Stop probing; remove every sandbox of this instance on the hosts that answer (those on a
        host that is out are removed by the next pool that finds it, their owner being dead)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        removed = await asyncio.gather(*(self._close_host(h) for h in self.hosts))
        return sum(removed)

    async def _close_host(self, host: DockerHost) -> int:
        if host.down is not None:
            await host.backend.api.close()
            return 0
        try:
            return await host.backend.close()
        except SandboxError as e:
            log.warning("could not remove the sandboxes on Docker host %s: %s", host.address, e)
            return 0

    def close_sync(self) -> int:
        removed = 0
        for host in self.hosts:
            if host.down is None:
                try:
                    removed += host.backend.close_sync()
                except (OSError, SandboxError) as e:
                    log.warning("at exit: could not remove the sandboxes on Docker host %s: %s",
                                host.address, e)
        return removed

    async def live_ids(self) -> list[str]:
        lists = await asyncio.gather(*(h.backend.live_ids() for h in self.hosts if h.down is None),
                                     return_exceptions=True)
        return [cid for ids in lists if isinstance(ids, list) for cid in ids]

    def stats(self) -> dict[str, Any]:
        return {"hosts": {h.address: {"up": h.down is None, "sandboxes": len(h.sandboxes)}
                          for h in self.hosts}}

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
