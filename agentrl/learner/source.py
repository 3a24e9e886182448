"""Where the learner's batches come from and where its weights go: serve's buffer and weight route.

Role: the learner loop's one seam to the outside, used on rank 0 only. ``ServeSource`` is the
product: ``BufferClient`` for batches and acks, and for weights the transport that
``cfg.weights.transport`` chooses (:func:`agentrl.weights.transports.make_transport`: HTTP chunks,
or an NCCL broadcast from the GPU). A test or benchmark may pass any object with the same methods
(``BatchSource``).

Invariants: ``get_batch`` leases (the batch is served again unless acked); ``ack`` is idempotent
and answers False for a batch the buffer no longer knows; ``release`` returns every lease of a
previous learner to the pending samples; ``publish`` returns once engines serve the version, and
takes the full weights on ``weights_device``; ``info`` may be called again at any time (the
learner asks serve's version to notice a serve that came back at an older one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.learner.config import LearnConfig

if TYPE_CHECKING:
    from agentrl.buffer.sample import Sample

log = logging.getLogger(__name__)


class BatchSource(Protocol):
    publishes: bool  # False: the learner skips gathering weights for publish()

    @property
    def weights_device(self) -> str: ...  # where publish() wants the weights: "cpu" or "cuda" (if publishes)

    # {"model_path": ..., "version": ...}; with several policies on one base also
    # "policies": {name: {"version": ..., "max_staleness": ...}} (in serve's order)
    async def info(self) -> dict[str, Any]: ...

    # None: nothing yet. ``policy`` (only with several policies): a batch of that policy's samples,
    # ``version`` being that policy's
    async def get_batch(self, version: int, *,
                        policy: str | None = None) -> tuple[str, list[Sample]] | None: ...

    # ``policy`` (only with several policies): ``state`` is that policy's adapter alone
    async def publish(self, state: dict[str, Any], version: int, *,
                      policy: str | None = None) -> dict[str, Any]: ...

    async def ack(self, batch_id: str) -> bool: ...

    async def release(self) -> int: ...

    async def close(self) -> None: ...


class ServeSource:
    """Batches from serve's buffer over HTTP; weights through the configured weight transport."""

    publishes = True

    def __init__(self, cfg: LearnConfig) -> None:
        from agentrl.buffer import BufferClient
        from agentrl.client import ServeClient
        from agentrl.weights.transports import make_transport

        self.cfg = cfg
        self.token = self._token()
        self.http = ServeClient(cfg.serve, self.token, timeout_s=60.0)
        self.client = BufferClient(cfg.serve, client=self.http)
        self.transport = make_transport(cfg.weights.transport, cfg.serve, self.token, lora=cfg.lora,
                                        base_model=cfg.model)
        # the batch size and staleness bound: the learner's own, or (0 / -1) serve's buffer's (info)
        self.batch_size = cfg.batch_size or None
        self.max_staleness = cfg.max_staleness if cfg.max_staleness >= 0 else None
        # with several policies: each one's bound (serve's, or the learner's)
        self.policy_staleness: dict[str, int] = {}
        self._told = False

    @property
    def weights_device(self) -> str:
        return self.transport.device

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
        """serve's model and version (waiting for serve up to ``batch_timeout_s``, 0: for ever); fills
        in the batch size and staleness bound the learner takes from serve's buffer."""
        from agentrl.errors import TransportError

        cfg = self.cfg
        deadline = time.monotonic() + cfg.batch_timeout_s
        while True:
            try:
                info = await self.http.json("GET", "/admin/info", timeout_s=10.0, retries=0)
                break
            except TransportError as e:
                if not e.retryable:
                    raise SystemExit(f"serve at {cfg.serve} refused /admin/info: {e}") from None
                if cfg.batch_timeout_s and time.monotonic() > deadline:
                    raise SystemExit(f"serve at {cfg.serve} did not answer: {e}") from None
                log.info("waiting for serve at %s", cfg.serve)
                await asyncio.sleep(2.0)
        if self.batch_size is None:
            self.batch_size = int(info.get("batch_size") or 16)
        if self.max_staleness is None:
            self.max_staleness = int(info.get("max_staleness", 2))
        for name, policy in (info.get("policies") or {}).items():
            self.policy_staleness[name] = cfg.max_staleness if cfg.max_staleness >= 0 else \
                int(policy.get("max_staleness", self.max_staleness))
        if not self._told:  # said once: the learner asks again later, for serve's version
            self._told = True
            log.info("batches of %d samples at most %d versions old", self.batch_size, self.max_staleness)
        return info

    async def get_batch(self, version: int, *, policy: str | None = None) -> tuple[str, list[Sample]] | None:
        # numpy per-token fields straight from the wire bytes; packing makes tensors of them
        if policy is None:
            batch = await self.client.get_batch(version, self.max_staleness, self.batch_size, timeout_s=30.0)
        else:
            # a short wait: the learner asks the next policy while this one has nothing ready
            staleness = self.policy_staleness.get(policy, self.max_staleness)
            batch = await self.client.get_batch(version, staleness, self.batch_size,
                                                timeout_s=self.cfg.policy_wait_s, policy=policy)
        return None if batch is None else (batch.batch_id, batch.samples)

    async def publish(self, state: dict[str, Any], version: int, *,
                      policy: str | None = None) -> dict[str, Any]:
        from agentrl.weights import EnginesFailed, WeightTransferError

        try:
            if policy is not None:  # a named policy: its adapter (the adapter transport alone carries one)
                return await self.transport.publish(state, version, policy=policy)
            return await self.transport.publish(state, version)
        except EnginesFailed as e:
            # Every engine failed to load this version; serve keeps serving the previous one and the
            # next version is a fresh attempt. Training goes on; the failure is in the metrics.
            log.error("version %d was not loaded by any engine: %s", version, e)
            return {"error": str(e)}
        except WeightTransferError as e:
            if not e.unreachable:
                # serve answered and refused, or the transport cannot work: sending again would not help
                raise
            # serve did not answer (restarting?): the learner rides it out; its next pull waits for
            # serve and publishes again if serve then serves an older version
            log.warning("serve did not take version %d (%s); it gets the weights again once it answers",
                        version, e)
            return {"error": str(e), "unreachable": True}

    async def ack(self, batch_id: str) -> bool:
        return await self.client.ack(batch_id)

    async def release(self) -> int:
        return await self.client.release_leases()

    async def close(self) -> None:
        try:
            await self.transport.close()
        finally:
            await self.http.close()
