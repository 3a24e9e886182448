"""The router's side of routed-expert capture, for mixture-of-experts models (routing replay).

Engines serve launches carry :class:`agentrl.engines.routing.RoutedExpertsCapture` in their worker
extension. :meth:`ExpertCapture.bind` turns it on in one engine (at start, and again before an
engine that was out takes traffic: a relaunched engine starts without it); after each recorded
call, :meth:`ExpertCapture.fetch` takes the routing of that call's choices from the engine that
ran it, and the router keeps it on the call's record (``Completion.routing``), from which the
session's samples get their ``routing`` array (:func:`agentrl.router.sessions.chain_routing`).

A call whose routing cannot be fetched (an engine without the extension, an error) is served as
usual: its sample has no recorded experts there and the learner routes those tokens itself. Each
such call is counted (``routing_missing``) and the first one logged.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

from agentrl.engines.pool import Engine, EnginePool
from agentrl.router.errors import EngineError

log = logging.getLogger(__name__)


def _results(text: str) -> list[Any]:
    """The workers' answers in a ``/collective_rpc`` response."""
    results = json.loads(text).get("results")
    if not isinstance(results, list) or not results:
        raise ValueError(f"no results in the answer {text[:200]!r}")
    return results


class ExpertCapture:
    """Binds capture on a pool's engines and fetches each recorded call's routing."""

    def __init__(self, pool: EnginePool, counters: dict[str, float]) -> None:
        """``counters``: the router's (``routing_captured``, ``routing_missing``)."""
        self.pool = pool
        self.counters = counters
        self.layers: dict[str, int] = {}  # engine name -> MoE layers its capture is bound to (0: none)
        pool.on_ready.append(self.bind)

    async def _rpc(self, engine: Engine, body: dict[str, Any]) -> Any:
        """One ``/collective_rpc`` call, the first worker's answer. A keep-alive connection the engine
        closed while it sat idle fails before the engine reads anything: tried again, twice at most."""
        for _ in range(2):
            try:
                return _results(await self.pool.control(engine, "/collective_rpc", body))[0]
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                continue  # on a new connection
        return _results(await self.pool.control(engine, "/collective_rpc", body))[0]

    async def bind_all(self) -> None:
        for engine in self.pool.engines:
            await self.bind(engine)

    async def bind(self, engine: Engine) -> None:
        """Turn capture on in ``engine`` (idempotent). An engine that cannot capture is warned of
        and serves without it."""
        try:
            self.layers[engine.name] = int(await self._rpc(engine, {"method": "agentrl_capture_experts"}))
        except (EngineError, aiohttp.ClientError, TimeoutError, ValueError, TypeError) as e:
            self.layers[engine.name] = 0
            log.warning("%s cannot capture routed experts (%s): its calls' tokens are routed by the learner",
                        engine.name, e)
            return
        if not self.layers[engine.name]:
            log.warning(
                "%s serves no MoE layer to capture: its calls' tokens are routed by the learner", engine.name
            )
        else:
            log.info("%s captures the routed experts of %d MoE layers", engine.name, self.layers[engine.name])

    async def fetch(self, engine: Engine, request_id: str, n: int) -> list[dict[str, Any] | None]:
        """The routing of each of the ``n`` choices of the call ``request_id`` ``engine`` ran (None
        for a choice without one)."""
        got: dict[int, dict[str, Any]] = {}
        if self.layers.get(engine.name):
            try:
                entries = await self._rpc(engine, {"method": "agentrl_routed_experts",
                                                   "kwargs": {"request_id": request_id}})
                got = {int(e["choice"]): e for e in entries}
            except (EngineError, aiohttp.ClientError, TimeoutError, ValueError, TypeError, KeyError) as e:
                if not self.counters["routing_missing"]:
                    log.warning("the routed experts of a call on %s could not "
                                "be fetched (%s): the learner routes its "
                                "tokens itself (counted as routing_missing)", engine.name, e)
        out = [got.get(i) for i in range(n)]
        self.counters["routing_missing"] += sum(x is None for x in out)
        self.counters["routing_captured"] += sum(x is not None for x in out)
        return out
