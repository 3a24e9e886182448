"""Self-distillation's teacher: the student's own policy some versions back, hot-swapped by serve.

With ``scoring.teacher.lag = N`` (and ``every = K``) serve launches one more engine of the same
model, with the same flags and key as its own, that no agent loop uses: the teacher. Each time a
new policy version ``v`` is loaded into serve's engines (before the learner's publish is answered), the
teacher is brought to version
``floor((v - N) / K) * K`` when that is newer than the one it serves (the base model is version 0),
through the same update choreography as the rollout engines (``agentrl.weights.updates``). So the
teacher trails the student by N to N + K - 1 versions and moves in steps of K. The teacher scorer
(:class:`agentrl.scoring.teacher.Teacher`) scores each episode on it and records the teacher's
version on every sample it scores (``info["teacher"]["version"]``). serve keeps the last N + K
versions' weights on disk (``weights/v<N>``) for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class SelfTeacher:
    """The teacher engine and what brings it to its version."""

    def __init__(self, cfg: Any, model_path: str, engine_key: str, log_dir: Path) -> None:
        """``cfg``: serve's config; ``engine_key``: the key serve's own engines answer."""
        from agentrl.serve.build import restart_policy
        from agentrl.serve.local import LocalEngines

        self.lag, self.every = cfg.scoring.teacher.lag, cfg.scoring.teacher.every
        self.policy = restart_policy(cfg)
        self.engine_key = engine_key
        spec = dataclasses.replace(cfg.engine.spec(cfg.engine.count, model_path, "teacher"), api_key=engine_key)
        self.local = LocalEngines([spec], log_dir)
        self.version = 0
        self.updater: Any = None
        self._lock = asyncio.Lock()
        self.failures = 0

    @property
    def url(self) -> str:
        return self.local.urls[0]

    async def start(self, timeout_s: float) -> None:
        """Launch the teacher engine and wait until it serves the base model (version 0). It is
        supervised as serve's own engines are: one that dies is relaunched and reloads the teacher's
        version before it answers again."""
        from agentrl.router import EnginePool
        from agentrl.weights import EngineUpdater

        await self.local.wait_ports_free()
        self.local.launch()
        await self.local.start(timeout_s)
        pool = EnginePool([self.url], api_key=self.engine_key)
        await pool.start()
        self.updater = EngineUpdater(pool)
        await self.updater.start()
        self.local.supervise(pool, self.policy)

    def target(self, version: int) -> int:
        """The teacher's version once the student is at ``version``."""
        return max(0, (version - self.lag) // self.every * self.every)

    async def advance(self, version: int, weights_root: Path) -> None:
        """serve's engines now serve ``version``: bring the teacher along (awaited by the commit that
        loaded ``version``, so the learner's publish answers once the teacher is where it belongs)."""
        async with self._lock:
            target = self.target(version)
            if target <= self.version:
                return
            path = weights_root / f"v{target}"
            try:
                await self.updater.update_weights(str(path), target)
            except Exception as e:  # the teacher stays where it was; the next version tries again
                self.failures += 1
                log.warning("the self-distillation teacher could not load version %d from %s: %s", target, path, e)
                return
            self.version = target
            log.info("self-distillation teacher now serves policy version %d (the student is at %d)", target, version)

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "version": self.version, "lag": self.lag, "every": self.every,
                "failures": self.failures, **self.local.status()[0]}

    async def close(self) -> None:
        if self.updater is not None:
            await self.updater.pool.close()
        await self.local.stop()
