"""Which renderer a chat call takes, and the calibration that decides it.

Two renderers (:mod:`agentrl.router.render`): the engine's render/derender routes (always right,
three round trips per completion) and the local one (the model folder's tokenizer and chat template,
in process). Invariant: the local renderer takes a call only once it was calibrated against a live
engine and agreed (state "on"), and only for a body it renders exactly; until then, and for ever
after a disagreement (state "off"), calls take the engine's routes. Calibration runs once, under a
lock, on the first call (or :meth:`Renderers.calibrate` at start); an engine failure during it
leaves the state "unchecked" for a later call to try again.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp

from agentrl.engines.pool import Engine, EnginePool
from agentrl.router.chat_parity import TokenText
from agentrl.router.errors import RouterError
from agentrl.router.render import EngineRenderer, LocalRenderer, Renderer

log = logging.getLogger(__name__)


class Renderers:
    def __init__(self, pool: EnginePool, *, model_name: str, eos_token_ids: set[int], max_model_len: int,
                 model_dir: str | Path | None, render: str, counters: dict[str, float]) -> None:
        """``render``: "auto" renders locally when the tokenizer allows it and calibration agrees;
        "engine" always uses the engine's routes. ``eos_token_ids`` is the router's own set (it
        grows as engines report stop tokens), shared, not copied."""
        if render not in ("auto", "engine"):
            raise ValueError(f"render must be 'auto' or 'engine', not {render!r}")
        self.pool = pool
        self.model_name = model_name
        self.eos_token_ids = eos_token_ids
        self._calibrating = asyncio.Lock()
        self.engine = EngineRenderer(pool, max_model_len=max_model_len, counters=counters)
        self.local: LocalRenderer | None = LocalRenderer.load(
            model_dir, max_model_len=max_model_len, fallback=self.engine,
            counters=counters) if render == "auto" else None
        # the chat route's view of generated ids (special tokens, logprob token text): needs the tokenizer
        self.token_text = TokenText(self.local.tok) if self.local is not None else None

    @property
    def state(self) -> str:
        """The local renderer's state: "unchecked" (not calibrated yet), "on", or "off"."""
        return self.local.state if self.local is not None else "off"

    async def calibrate_local(self, engine: Engine) -> None:
        """Calibrate the local renderer on a live engine, once; until it agreed, calls use the engine's
        routes."""
        async with self._calibrating:
            local = self.local
            if local is None or local.state != "unchecked":
                return
            try:
                why = await local.calibrate(self.pool, engine)
            except (RouterError, OSError, TimeoutError, aiohttp.ClientError) as e:
                # the engine failed: this call takes the engine's routes (and fails or is retried
                # there); calibration is tried again on a later call
                log.warning("could not calibrate the local render on %s: %s", engine.name, e)
                return
            if why is None:
                local.state = "on"
                log.info("rendering and derendering locally (calibrated on %s)", engine.name)
            else:
                local.state = "off"
                log.warning("local render differs from the engine's (%s): using the engine's "
                            "render/derender routes", why)

    async def calibrate(self, engine: Engine) -> None:
        """Every check the call path would otherwise make on its first calls: the local render
        against the engine, and for each renderer whether continued calls render linearly."""
        await self.calibrate_local(engine)
        renderers: list[Renderer] = [self.engine]
        if self.local is not None and self.local.state == "on":
            renderers.append(self.local)
        for r in renderers:  # each checks once; a decided one returns at once
            await r.check_continuations(engine, self.model_name, self.eos_token_ids)

    async def for_call(self, engine: Engine, body: dict[str, Any]) -> Renderer:
        """The call's renderer: local when calibrated and it renders this body exactly, else the engine's."""
        if self.local is not None and self.local.state == "unchecked":
            await self.calibrate_local(engine)
        if self.local is not None and self.local.state == "on" and self.local.can_render(body):
            return self.local
        return self.engine
