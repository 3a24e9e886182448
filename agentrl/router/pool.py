"""The engine pool: which vLLM engine serves a call, and the weight-update choreography.

Balancing is least-outstanding-requests with session affinity (a session's turns go to the engine
that holds its prefix cache while that engine is healthy). An engine that fails a health check or
a connection is taken out; a background checker re-adds it when it answers again, after bringing
it to the current policy version. Weight updates are serialised by a lock; every step has a
timeout, and engines are resumed whatever happens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from agentrl.router.errors import EngineError, InvalidRequest, NoEngineAvailable

log = logging.getLogger(__name__)


@dataclass
class Engine:
    url: str
    name: str
    healthy: bool = True
    outstanding: int = 0
    version: int = 0
    served: int = 0
    failures: int = 0
    last_error: str = ""
    sessions: set[str] = field(default_factory=set)

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "name": self.name, "healthy": self.healthy, "outstanding": self.outstanding,
                "version": self.version, "served": self.served, "failures": self.failures,
                "last_error": self.last_error}


def parse_version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


class EnginePool:
    def __init__(self, urls: list[str], *, request_timeout_s: float = 600.0, control_timeout_s: float = 60.0,
                 health_interval_s: float = 2.0) -> None:
        if not urls:
            raise ValueError("the engine pool needs at least one engine URL")
        self.engines = [Engine(url=u.rstrip("/"), name=f"engine-{i}") for i, u in enumerate(urls)]
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_interval_s = health_interval_s
        self.version = 0
        self.updating = False
        self._affinity: dict[str, Engine] = {}
        self._update_lock = asyncio.Lock()
        self._http: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self.weights_path: str | None = None

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await asyncio.gather(*(self._set_version(e, self.version) for e in self.engines), return_exceptions=True)
        self._health_task = asyncio.create_task(self._health_loop(), name="engine-health")

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._http:
            await self._http.close()

    # -- choosing an engine ----------------------------------------------------------------------
    def pick(self, session_id: str | None) -> Engine:
        if session_id is not None:
            e = self._affinity.get(session_id)
            if e is not None and e.healthy:
                return e
        healthy = [e for e in self.engines if e.healthy]
        if not healthy:
            raise NoEngineAvailable("no healthy inference engine is available; check `agentrl status`")
        e = min(healthy, key=lambda x: x.outstanding)
        if session_id is not None:
            self._affinity[session_id] = e
        return e

    def forget_session(self, session_id: str) -> None:
        self._affinity.pop(session_id, None)

    # -- calls -------------------------------------------------------------------------------------
    async def call(self, engine: Engine, path: str, body: dict[str, Any], timeout_s: float | None = None,
                   count: bool = True) -> dict[str, Any]:
        """POST to one engine. 4xx -> InvalidRequest (never retried); other failures -> EngineError."""
        assert self._http is not None, "EnginePool.start() was not awaited"
        if count:
            engine.outstanding += 1
        try:
            async with self._http.post(engine.url + path, json=body,
                                       timeout=aiohttp.ClientTimeout(total=timeout_s or self.request_timeout_s)) as r:
                if r.status >= 400:
                    text = await r.text()
                    message = _engine_message(text)
                    if 400 <= r.status < 500:
                        code = "context_length_exceeded" if "context length" in message.lower() else None
                        raise InvalidRequest(message, status=r.status if r.status != 404 else 400, code=code)
                    raise EngineError(f"engine {engine.name} answered {r.status}: {message}")
                data = await r.json()
                engine.served += 1
                return data
        except (TimeoutError, aiohttp.ClientConnectionError) as e:
            engine.failures += 1
            engine.last_error = f"{type(e).__name__}: {e}"
            if isinstance(e, aiohttp.ClientConnectionError):
                self._mark_down(engine, engine.last_error)
            raise EngineError(f"engine {engine.name} failed: {engine.last_error or type(e).__name__}") from e
        finally:
            if count:
                engine.outstanding -= 1

    def _mark_down(self, engine: Engine, why: str) -> None:
        if engine.healthy:
            log.warning("taking %s (%s) out of the pool: %s", engine.name, engine.url, why)
        engine.healthy = False
        for sid in [s for s, e in self._affinity.items() if e is engine]:
            del self._affinity[sid]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._check(e) for e in self.engines), return_exceptions=True)

    async def _check(self, engine: Engine) -> None:
        assert self._http is not None
        try:
            async with self._http.get(engine.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                ok = r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if not ok:
            self._mark_down(engine, "health check failed")
            return
        if not engine.healthy and not self.updating:
            async with self._update_lock:  # a returning engine joins at the current version
                try:
                    if self.weights_path and engine.version != self.version:
                        await self._update_one(engine, self.weights_path, self.version)
                    else:
                        await self._set_version(engine, self.version)
                except Exception as e:
                    log.warning("%s answered but could not be brought to version %d: %s", engine.name, self.version, e)
                    return
            engine.healthy = True
            log.info("%s (%s) is back in the pool at version %d", engine.name, engine.url, self.version)

    # -- weight updates ---------------------------------------------------------------------------
    async def _control(self, engine: Engine, path: str, body: dict | None = None, params: dict | None = None,
                       timeout_s: float | None = None) -> Any:
        assert self._http is not None
        async with self._http.post(engine.url + path, json=body, params=params,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s or self.control_timeout_s)) as r:
            text = await r.text()
            if r.status >= 400:
                raise EngineError(f"{engine.name} {path} answered {r.status}: {text[:300]}")
            return text

    async def _set_version(self, engine: Engine, version: int) -> None:
        await self._control(engine, "/update_weight_version", {"new_version": str(version)})
        engine.version = version

    async def _update_one(self, engine: Engine, weights_path: str, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        await self._control(engine, "/pause", params={"mode": "keep"})
        t_paused = time.perf_counter()
        try:
            await self._control(engine, "/collective_rpc",
                                {"method": "reload_weights", "kwargs": {"weights_path": weights_path}})
            t_reloaded = time.perf_counter()
            # KV blocks computed under the old weights must not serve new tokens: drop the prefix
            # cache and have in-flight requests re-prefill (they continue; none is aborted), so every
            # token stamped with the new version really is the new policy's.
            text = await self._control(engine, "/reset_prefix_cache", params={"reset_running_requests": "true"})
            if '"success":true' not in text.replace(" ", ""):
                raise EngineError(f"{engine.name} could not reset its prefix cache after the reload: {text[:200]}")
            await self._set_version(engine, version)
        finally:
            # Never leave an engine paused: resume even if the reload failed or we were cancelled.
            await asyncio.shield(self._resume(engine))
        t_resumed = time.perf_counter()
        return {"pause_s": t_paused - t0, "reload_s": t_reloaded - t_paused,
                "pause_window_s": t_resumed - t_paused, "total_s": t_resumed - t0}

    async def _resume(self, engine: Engine) -> None:
        try:
            await self._control(engine, "/resume", timeout_s=10)
        except Exception as e:
            log.error("could not resume %s: %s; taking it out of the pool", engine.name, e)
            self._mark_down(engine, f"resume failed: {e}")

    async def update_weights(self, weights_path: str, version: int, timeout_s: float = 300.0) -> dict[str, Any]:
        """Load ``weights_path`` into every healthy engine and stamp it ``version``.

        Engines that fail are taken out of the pool (the health checker re-adds them at the current
        version); the update succeeds if at least one engine took it.
        """
        async with self._update_lock:
            self.updating = True
            try:
                targets = [e for e in self.engines if e.healthy]
                results = await asyncio.gather(
                    *(asyncio.wait_for(self._update_one(e, weights_path, version), timeout_s) for e in targets),
                    return_exceptions=True,
                )
                per_engine: dict[str, Any] = {}
                ok = 0
                for e, res in zip(targets, results, strict=True):
                    if isinstance(res, BaseException):
                        self._mark_down(e, f"weight update failed: {type(res).__name__}: {res}")
                        per_engine[e.name] = {"error": f"{type(res).__name__}: {res}"}
                    else:
                        ok += 1
                        per_engine[e.name] = res
                if ok == 0:
                    raise EngineError(f"weight update to version {version} failed on every engine: {per_engine}")
                self.version = version
                self.weights_path = weights_path
                return {"version": version, "engines": per_engine}
            finally:
                self.updating = False

    def status(self) -> list[dict[str, Any]]:
        return [e.status() for e in self.engines]


def _engine_message(text: str) -> str:
    import json

    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:1000]
    return str(err)[:1000]
