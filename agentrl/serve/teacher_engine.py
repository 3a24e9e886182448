"""The teacher engine serve launches for on-policy distillation: a model of its own, or (self-
distillation) the student's own policy some versions back, hot-swapped by serve.

With ``scoring.teacher.model`` and no ``url``, serve launches one more engine, with the same flags
and key as its own, serving that model (resolved as ``serve.model`` is: ``tiny-agent``, a folder, a
hub name), which no agent loop uses, and checks that it shares the student's tokenizer; it stays
at that model. With ``scoring.teacher.lag = N`` (and ``every = K``) that engine serves the student's
own model instead. Each time a
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.serve.config import ServeConfig
    from agentrl.weights.updates import EngineUpdater

log = logging.getLogger(__name__)


def check_same_tokenizer(student: str, teacher: str) -> None:
    """A teacher scores the student's token ids, so the two must read them alike: the same
    vocabulary, id for id. Raises ConfigError naming both otherwise."""
    from transformers import AutoTokenizer

    from agentrl.errors import ConfigError

    a, b = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    if a.get_vocab() != b.get_vocab():
        raise ConfigError(f"scoring.teacher.model {teacher} has another tokenizer than the student's "
                          f"({student}: {len(a)} tokens against {len(b)}, or the same ids mean other "
                          "text): a teacher scores the student's token ids and must share its tokenizer")


class TeacherEngine:
    """The teacher engine and, for self-distillation, what brings it to its version."""

    def __init__(self, cfg: ServeConfig, model_path: str, engine_key: str, log_dir: Path) -> None:
        """``cfg``: serve's config; ``model_path``: the model the engine starts with (the student's
        for self-distillation); ``engine_key``: the key serve's own engines answer."""
        from agentrl.serve.build import restart_policy
        from agentrl.serve.local import LocalEngines

        self.lag, self.every = cfg.scoring.teacher.lag, cfg.scoring.teacher.every
        self.follows = self.lag > 0  # self-distillation: it trails the student; else it stays at its model
        self.model_path = model_path
        self.policy = restart_policy(cfg)
        self.engine_key = engine_key
        spec = dataclasses.replace(
            cfg.engine.spec(cfg.engine.count, model_path, "teacher"), api_key=engine_key
        )
        self.local = LocalEngines([spec], log_dir)
        self.version = 0
        self.updater: EngineUpdater | None = None
        self._lock = asyncio.Lock()
        self.failures = 0

    @property
    def url(self) -> str:
        return self.local.urls[0]

    async def start(self, timeout_s: float) -> None:
        """Launch the teacher engine and wait until it serves the base model (version 0). It is
        supervised as serve's own engines are: one that dies is relaunched and reloads the teacher's
        version before it answers again."""
        from agentrl.engines.pool import EnginePool
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
        if not self.follows:
            return
        async with self._lock:
            target = self.target(version)
            if target <= self.version:
                return
            path = weights_root / f"v{target}"
            try:
                await self.updater.update_weights(str(path), target)
            except Exception as e:  # the teacher stays where it was; the next version tries again
                self.failures += 1
                log.warning(
                    "the self-distillation teacher could not load version %d from %s: %s", target, path, e
                )
                return
            self.version = target
            log.info(
                "self-distillation teacher now serves policy version %d (the student is at %d)",
                target,
                version,
            )

    def status(self) -> dict[str, Any]:
        own = {"version": self.version, "lag": self.lag, "every": self.every} if self.follows else \
            {"model": self.model_path}
        return {"url": self.url, **own, "failures": self.failures, **self.local.status()[0]}

    async def close(self) -> None:
        if self.updater is not None:
            await self.updater.pool.close()
        await self.local.stop()
