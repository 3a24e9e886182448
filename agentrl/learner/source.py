"""Where the learner's batches come from and where its weights go: serve's buffer and weight route.

Role: the learner loop's one seam to the outside, used on rank 0 only. ``ServeSource`` is the
product (``BufferClient`` for batches and acks, ``agentrl.weights.publish`` for weights); a test
or benchmark may pass any object with the same methods (``BatchSource``).

Invariants: ``get_batch`` leases (the batch is served again unless acked); ``ack`` is idempotent
and answers False for a batch the buffer no longer knows; ``release`` returns every lease of a
previous learner to the pending samples; ``publish`` returns once engines serve the version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from agentrl.config import LearnConfig

log = logging.getLogger(__name__)


class BatchSource(Protocol):
    publishes: bool  # False: the learner skips gathering weights for publish()

    async def info(self) -> dict[str, Any]: ...  # {"model_path": ..., "version": ...}

    async def get_batch(self, version: int) -> tuple[str, list[Any]] | None: ...  # None: nothing yet

    async def publish(self, state: dict[str, Any], version: int) -> dict[str, Any]: ...

    async def ack(self, batch_id: str) -> bool: ...

    async def release(self) -> int: ...

    async def close(self) -> None: ...


class ServeSource:
    """Batches from serve's buffer over HTTP; weights to serve's weight route."""

    publishes = True

    def __init__(self, cfg: LearnConfig) -> None:
        from agentrl.buffer import BufferClient

        self.cfg = cfg
        self.token = self._token()
        self.client = BufferClient(cfg.serve, self.token, timeout_s=60.0)

    def _token(self) -> str:
        from agentrl.credentials import SecretError, find_admin_token

        cfg = self.cfg
        try:
            token = find_admin_token(cfg.admin_token, cfg.admin_token_file, cfg.run_dir)
        except SecretError as e:
            raise SystemExit(f"agentrl learn: {e}") from None
        if not token:
            raise SystemExit("agentrl learn needs serve's admin token: pass --admin_token_file=FILE, set "
                             "$AGENTRL_ADMIN_TOKEN or $AGENTRL_ADMIN_TOKEN_FILE, or point run_dir at serve's "
                             "run directory")
        return token

    async def info(self) -> dict[str, Any]:
        import aiohttp

        cfg = self.cfg
        deadline = time.monotonic() + cfg.batch_timeout_s
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.token}"}) as http:
            while True:
                try:
                    async with http.get(f"{cfg.serve}/admin/info", timeout=aiohttp.ClientTimeout(total=10)) as r:
                        if r.status == 200:
                            return await r.json()
                        raise SystemExit(f"serve at {cfg.serve} answered {r.status}: {await r.text()}")
                except (TimeoutError, aiohttp.ClientConnectionError):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"serve at {cfg.serve} did not answer") from None
                    log.info("waiting for serve at %s", cfg.serve)
                    await asyncio.sleep(2.0)

    async def get_batch(self, version: int) -> tuple[str, list[Any]] | None:
        # numpy per-token fields straight from the wire bytes; packing makes tensors of them
        batch = await self.client.get_batch(version, self.cfg.max_staleness, self.cfg.batch_size, timeout_s=30.0)
        return None if batch is None else (batch.batch_id, batch.samples)

    async def publish(self, state: dict[str, Any], version: int) -> dict[str, Any]:
        from agentrl.weights import EnginesFailed, publish, serialize_state_dict

        data = await asyncio.to_thread(serialize_state_dict, state)
        try:
            return await publish(data, version, self.cfg.serve, self.token)
        except EnginesFailed as e:
            # Every engine failed to load this version; serve keeps serving the previous one and the
            # next version is a fresh attempt. Training goes on; the failure is in the metrics.
            log.error("version %d was not loaded by any engine: %s", version, e)
            return {"error": str(e)}

    async def ack(self, batch_id: str) -> bool:
        return await self.client.ack(batch_id)

    async def release(self) -> int:
        return await self.client.release_leases()

    async def close(self) -> None:
        await self.client.close()
