"""Engines on this machine: serve's vLLM engines as child processes (the one-machine default).

Each engine runs through :mod:`agentrl.engines.reaper`, so it dies with serve however serve ends.
Launching happens from the calling (main) thread: the reaper's parent-death signal follows the
thread that spawned it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from agentrl.engines.vllm import EngineSpec, VLLMEngine

log = logging.getLogger(__name__)


class LocalEngines:
    """The engines serve launches itself: ``launch()``, ``await start()``, then ``urls``; ``await stop()``."""

    def __init__(self, specs: list[EngineSpec], log_dir: Path) -> None:
        self.engines = [VLLMEngine(spec, log_dir) for spec in specs]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def launch(self) -> None:
        for engine in self.engines:
            engine.launch()

    async def start(self, timeout_s: float) -> list[str]:
        """Wait until every engine answers ``/health``; their URLs."""
        await asyncio.gather(*(e.start(timeout_s) for e in self.engines))
        return self.urls

    async def stop(self) -> None:
        for engine in self.engines:
            await asyncio.to_thread(engine.stop)
