"""The one place an environment gets its sandbox: a pool for the image it declares, and a sandbox
attached to it for one episode.

An environment declares ``sandbox_image`` (None: it needs none). :func:`pool_for` makes the pool a
process needs for such an environment (serve, a Ray rollout worker, ``agentrl eval``, the gym
wrapper, ``agentrl envs try``), :func:`attached` hands one of its sandboxes to the environment as
``env.sandbox`` for the duration of a block and releases it however the block ends.

An environment whose tasks each need their own image (a folder of Harbor tasks, one Dockerfile
each) declares every image in ``sandbox_image``, comma-separated (no image reference contains a
comma), and names a task's image with ``sandbox_image_for(task)``; :func:`pool_for` then makes an
:class:`ImagePools`, one pool per image with the same limits, each started on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.errors import EnvironmentFailure
from agentrl.sandbox.types import SandboxConfig

if TYPE_CHECKING:
    from agentrl.sandbox.handle import Sandbox
    from agentrl.sandbox.pool import SandboxPool

E = TypeVar("E")  # an environment: anything with ``sandbox_image`` (and a ``sandbox`` to set)


class ImagePools:
    """One :class:`~agentrl.sandbox.pool.SandboxPool` per image, all with the same limits; a pool
    starts when its image is first asked for and keeps no warm sandboxes (many images, few used)."""

    def __init__(self, images: list[str], cfg: SandboxConfig, instance_id: str) -> None:
        self.images, self.cfg, self.instance_id = images, cfg, instance_id
        self.pools: dict[str, SandboxPool] = {}
        self._lock = asyncio.Lock()

    async def pool(self, image: str) -> SandboxPool:
        if image not in self.images:
            raise EnvironmentFailure(f"image {image!r} is not one of the environment's declared images")
        async with self._lock:
            if image not in self.pools:
                from agentrl.sandbox.pool import SandboxPool

                pool = SandboxPool(dataclasses.replace(self.cfg, image=image, warm=0),
                                   instance_id=f"{self.instance_id}-{self.images.index(image)}")
                await pool.start()
                self.pools[image] = pool
            return self.pools[image]

    @contextlib.asynccontextmanager
    async def acquire(self, image: str) -> AsyncIterator[Sandbox]:
        async with (await self.pool(image)).acquire() as sandbox:
            yield sandbox

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()


async def pool_for(image: str | None, cfg: SandboxConfig | None,
                   instance_id: str) -> SandboxPool | ImagePools | None:
    """A started :class:`~agentrl.sandbox.pool.SandboxPool` of ``image`` with ``cfg``'s limits, an
    :class:`ImagePools` when ``image`` lists several, or None when the environment needs no sandbox."""
    if not image:
        return None
    images = [i.strip() for i in image.split(",") if i.strip()]
    if len(images) > 1:
        return ImagePools(images, cfg or SandboxConfig(), instance_id)
    from agentrl.sandbox.pool import SandboxPool

    pool = SandboxPool(dataclasses.replace(cfg or SandboxConfig(), image=image), instance_id=instance_id)
    await pool.start()
    return pool


@contextlib.asynccontextmanager
async def attached(env: E, pool: SandboxPool | ImagePools | None,
                   task: dict[str, Any] | None = None) -> AsyncIterator[E]:
    """``env`` with a sandbox from ``pool`` as ``env.sandbox`` when it declares an image (else as it is);
    the sandbox goes back to the pool on the way out, cancellation included. Where the image
    depends on the task (``env.sandbox_image_for(task)``: one of several, or none for a task of a
    mix that needs none), ``task`` picks it."""
    per_task = task is not None and hasattr(env, "sandbox_image_for")
    image = env.sandbox_image_for(task) if per_task else env.sandbox_image
    if not image:
        yield env
        return
    if pool is None:
        raise EnvironmentFailure(f"{type(env).__name__} needs a sandbox ({image}) but none is configured")
    if isinstance(pool, ImagePools):
        if not per_task:
            raise EnvironmentFailure(f"{type(env).__name__} uses several "
                                     "images; which one depends on the task")
        acquiring = pool.acquire(image)
    else:
        acquiring = pool.acquire()
    async with acquiring as sandbox:
        env.sandbox = sandbox
        try:
            yield env
        finally:
            env.sandbox = None
