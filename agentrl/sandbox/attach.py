"""The one place an environment gets its sandbox: a pool for the image it declares, and a sandbox
attached to it for one episode.

An environment declares ``sandbox_image`` (None: it needs none). :func:`pool_for` makes the pool a
process needs for such an environment (serve, a Ray rollout worker, ``agentrl eval``, the gym
wrapper, ``agentrl envs try``), :func:`attached` hands one of its sandboxes to the environment as
``env.sandbox`` for the duration of a block and releases it however the block ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from agentrl.errors import EnvironmentFailure
from agentrl.sandbox.types import SandboxConfig


async def pool_for(image: str | None, cfg: SandboxConfig | None, instance_id: str) -> Any:
    """A started :class:`~agentrl.sandbox.pool.SandboxPool` of ``image`` with ``cfg``'s limits, or
    None when the environment needs no sandbox (``image`` None)."""
    if not image:
        return None
    from agentrl.sandbox.pool import SandboxPool

    pool = SandboxPool(dataclasses.replace(cfg or SandboxConfig(), image=image), instance_id=instance_id)
    await pool.start()
    return pool


@contextlib.asynccontextmanager
async def attached(env: Any, pool: Any) -> AsyncIterator[Any]:
    """``env`` with a sandbox from ``pool`` as ``env.sandbox`` when it declares an image (else as it is);
    the sandbox goes back to the pool on the way out, cancellation included."""
    if not env.sandbox_image:
        yield env
        return
    if pool is None:
        raise EnvironmentFailure(f"{type(env).__name__} needs a sandbox ({env.sandbox_image}) but none is configured")
    async with pool.acquire() as sandbox:
        env.sandbox = sandbox
        try:
            yield env
        finally:
            env.sandbox = None
