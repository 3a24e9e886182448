"""The engine pool: which vLLM engine serves a call, and the weight-update choreography.

Balancing is least-outstanding-requests with session affinity (a session's turns go to the engine
that holds its prefix cache while that engine is healthy). An engine that fails a health check or
a connection is taken out; a background checker re-adds it when it answers again, after bringing
it to the current policy version. Weight updates are serialised by a lock; every step has a
timeout, and engines are resumed whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from agentrl.router.errors import EngineError, InvalidRequest, NoEngineAvailable
from agentrl.router.upstream import Upstream, UpstreamClosed, UpstreamProtocolError

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
    failed_checks: int = 0  # consecutive failed health checks
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


def _rpc_results(text: str) -> list[dict[str, Any]]:
    """The workers' answers in a ``/collective_rpc`` response (``{"results": [...]}``) that are objects."""
    try:
        results = json.loads(text).get("results") or []
    except (ValueError, AttributeError):
        return []
    return [r for r in results if isinstance(r, dict)]


class EnginePool:
    def __init__(self, urls: list[str], *, request_timeout_s: float = 600.0, control_timeout_s: float = 60.0,
                 health_interval_s: float = 2.0, health_failures: int = 3) -> None:
        """``health_failures``: consecutive failed health checks before an engine is taken out (a
        refused or dropped connection during a call takes it out at once)."""
        if not urls:
            raise ValueError("the engine pool needs at least one engine URL")
        self.engines = [Engine(url=u.rstrip("/"), name=f"engine-{i}") for i, u in enumerate(urls)]
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_interval_s = health_interval_s
        self.health_failures = max(1, health_failures)
        self.version = 0
        self.updating = False
        self._affinity: dict[str, Engine] = {}
        self._update_lock = asyncio.Lock()
        self._http: aiohttp.ClientSession | None = None
        self._upstream = Upstream()  # the hot path (render / generate / derender calls)
        self._health_task: asyncio.Task | None = None
        self.weights_path: str | None = None
        # Closed (cleared) by the weight-update code around a pause window: new engine calls wait
        # here instead of failing; calls already in flight are kept by vLLM's pause(mode=keep).
        self.gate = asyncio.Event()
        self.gate.set()

    async def start(self) -> None:
        # Keep-alive connections, unbounded in number (a router at 1,024 concurrent calls keeps as
        # many open); ordinary HTTP/1.1, one request per connection at a time.
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                           skip_auto_headers=("User-Agent",))
        await asyncio.gather(*(self._set_version(e, self.version) for e in self.engines), return_exceptions=True)
        self._health_task = asyncio.create_task(self._health_loop(), name="engine-health")

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._http:
            await self._http.close()
        await self._upstream.close()

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
        if not self.gate.is_set():
            await self.wait_gate()
        if count:
            engine.outstanding += 1
        try:
            status, raw = await self._upstream.post(engine.url, path, dumps(body), timeout_s or self.request_timeout_s)
            if status >= 400:
                message = _engine_message(raw.decode(errors="replace"))
                if 400 <= status < 500:
                    code = "context_length_exceeded" if "context length" in message.lower() else None
                    raise InvalidRequest(message, status=status if status != 404 else 400, code=code)
                raise EngineError(f"engine {engine.name} answered {status}: {message}")
            data = loads(raw)
            engine.served += 1
            return data
        except (TimeoutError, UpstreamClosed, UpstreamProtocolError, ValueError) as e:
            engine.failures += 1
            what = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            engine.last_error = what
            if isinstance(e, UpstreamClosed):  # refused, reset or dropped: gone until its health check passes
                self._mark_down(engine, engine.last_error)
            raise EngineError(f"engine {engine.name} failed: {what}") from e
        finally:
            if count:
                engine.outstanding -= 1

    async def wait_gate(self) -> None:
        """Hold a new call while a weight update has the gate closed (bounded by the request timeout)."""
        try:
            await asyncio.wait_for(self.gate.wait(), self.request_timeout_s)
        except TimeoutError:
            raise EngineError("timed out waiting for a weight update to finish") from None

    async def stream(self, engine: Engine, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST a streaming request and yield each server-sent event's JSON (stops at ``[DONE]``).

        Same error mapping as :meth:`call`. A connection lost mid-stream takes the engine out.
        """
        assert self._http is not None, "EnginePool.start() was not awaited"
        if not self.gate.is_set():
            await self.wait_gate()
        engine.outstanding += 1
        try:
            async with self._http.post(engine.url + path, data=dumps(body), headers=_JSON,
                                       timeout=aiohttp.ClientTimeout(total=self.request_timeout_s)) as r:
                if r.status >= 400:
                    message = _engine_message(await r.text())
                    if 400 <= r.status < 500:
                        code = "context_length_exceeded" if "context length" in message.lower() else None
                        raise InvalidRequest(message, status=r.status if r.status != 404 else 400, code=code)
                    raise EngineError(f"engine {engine.name} answered {r.status}: {message}")
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event and "choices" not in event:
                        raise EngineError(f"engine {engine.name} failed mid-stream: {_engine_message(data.decode())}")
                    yield event
                engine.served += 1
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            engine.failures += 1
            engine.last_error = f"{type(e).__name__}: {e}"
            if not isinstance(e, TimeoutError):
                self._mark_down(engine, engine.last_error)
            raise EngineError(f"engine {engine.name} failed: {engine.last_error}") from e
        finally:
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
            engine.failed_checks += 1
            if engine.failed_checks >= self.health_failures:
                self._mark_down(engine, f"{engine.failed_checks} health checks failed in a row")
            return
        engine.failed_checks = 0
        if not engine.healthy and not self.updating:
            async with self._update_lock:  # a returning engine joins at the current version
                # The process may have restarted with its base weights, whatever version it last
                # reported: reload the current weights before it takes traffic.
                try:
                    if self.weights_path:
                        await self._update_one(engine, self.weights_path, self.version)
                    elif self.version == 0:
                        await self._set_version(engine, self.version)
                    else:  # NCCL-only versions are on no disk: it waits for the group to be re-formed
                        log.warning("%s answered but version %d exists only in the NCCL group; it stays out "
                                    "until the learner re-forms the group", engine.name, self.version)
                        return
                except Exception as e:
                    log.warning("%s answered but could not be brought to version %d: %s", engine.name, self.version, e)
                    return
            engine.healthy = True
            log.info("%s (%s) is back in the pool at version %d", engine.name, engine.url, self.version)

    # -- weight updates ---------------------------------------------------------------------------
    # Every step of an update has its own limit (seconds); override per pool with
    # ``pool.step_timeouts_s = dict(pool.step_timeouts_s, reload=...)``. ``update`` bounds one
    # engine's whole choreography, ``nccl_init`` the NCCL rendezvous.
    step_timeouts_s: dict[str, float] = {  # noqa: RUF012 - replaced, never mutated in place
        "stage": 60.0, "pause": 30.0, "reload": 300.0, "reset": 30.0, "version": 30.0, "resume": 10.0,
        "nccl_init": 120.0, "nccl_start": 30.0, "nccl_transfer": 300.0, "nccl_finish": 60.0, "update": 600.0,
    }
    resume_attempts: int = 3
    # Engines started with agentrl.weights.vllm_ext re-tie a tied LM head after each load (vLLM's
    # reload leaves the old one); None until the first engine says whether it has the extension.
    retie_supported: bool | None = None
    nccl_members: tuple[str, ...] = ()  # engine names in the NCCL weight-transfer group, in rank order

    async def _control(self, engine: Engine, path: str, body: dict | None = None, params: dict | None = None,
                       timeout_s: float | None = None) -> Any:
        assert self._http is not None
        async with self._http.post(engine.url + path, json=body, params=params,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s or self.control_timeout_s)) as r:
            text = await r.text()
            if r.status >= 400:
                raise EngineError(f"{engine.name} {path} answered {r.status}: {text[:300]}")
            return text

    async def _step(self, engine: Engine, step: str, path: str, body: dict | None = None,
                    params: dict | None = None) -> str:
        """One control call of an update, bounded by its own timeout; errors name the engine and step."""
        limit = self.step_timeouts_s[step]
        try:
            return await asyncio.wait_for(self._control(engine, path, body, params, timeout_s=limit), limit + 1.0)
        except TimeoutError as e:
            raise EngineError(f"{engine.name} ({engine.url}): step {step!r} ({path}) timed out after {limit:g} s") from e
        except aiohttp.ClientError as e:
            raise EngineError(f"{engine.name} ({engine.url}): step {step!r} ({path}) failed: "
                              f"{type(e).__name__}: {e}") from e

    async def _set_version(self, engine: Engine, version: int) -> None:
        await self._step(engine, "version", "/update_weight_version", {"new_version": str(version)})
        engine.version = version

    async def _apply(self, engine: Engine, version: int, load: Any, stage: Any = None) -> dict[str, float]:
        """``await stage(engine)`` -> pause(keep) -> ``await load(engine)`` -> reset prefix cache and
        set version -> resume.

        ``stage`` runs while the engine still generates (work that need not stand in the pause).
        In-flight requests stay in the engine across the pause; the reset makes them re-prefill
        under the new weights (none is aborted), so every token stamped ``version`` really is the
        new policy's. Resume runs whatever happens, even if the pause itself timed out.
        """
        staged = (await stage(engine) or {}) if stage is not None else {}
        t0 = time.perf_counter()
        t_paused = t_loaded = t0
        resumed = False
        try:
            await self._step(engine, "pause", "/pause", params={"mode": "keep"})
            t_paused = time.perf_counter()
            parts = await load(engine) or {}
            t_loaded = time.perf_counter()
            # Independent of each other, so one round trip for both; both finish before resume.
            reset, stamped = await asyncio.gather(
                self._step(engine, "reset", "/reset_prefix_cache", params={"reset_running_requests": "true"}),
                self._set_version(engine, version), return_exceptions=True)
            for outcome in (reset, stamped):
                if isinstance(outcome, BaseException):
                    raise outcome
            if '"success":true' not in str(reset).replace(" ", ""):
                raise EngineError(f"{engine.name} could not reset its prefix cache after the reload: {str(reset)[:200]}")
        finally:
            # Never leave an engine paused: resume even if a step failed or we were cancelled.
            resumed = await asyncio.shield(self._resume(engine))
        if not resumed:
            raise EngineError(f"{engine.name} ({engine.url}) loaded version {version} but could not be resumed")
        t_resumed = time.perf_counter()
        # The clock readings too (time.perf_counter, this process), so a caller can line them up
        # with what clients saw.
        return {"pause_s": t_paused - t0, "reload_s": t_loaded - t_paused,
                "pause_window_s": t_resumed - t_paused, "total_s": t_resumed - t0,
                "t_pause_sent": t0, "t_paused": t_paused, "t_resumed": t_resumed, **staged, **parts}

    async def _update_one(self, engine: Engine, weights_path: str, version: int) -> dict[str, float]:
        return await self._apply(engine, version, self._file_loader(weights_path), self._head_stager(weights_path))

    def _head_stager(self, weights_path: str) -> Any:
        """The step before the pause of a file update: the engine builds its tied LM head's kernel
        from the new embedding while it keeps generating (agentrl.weights.vllm_ext), and this waits
        until it is built, so the reload in the pause swaps it in instead of building it. Returns
        ``stage_s`` (as the pool saw it) and ``stage_worker_s`` (the build in the worker). Engines
        without the extension, or models without a tied head, cost one call; if it fails or takes
        longer than ``step_timeouts_s["stage"]``, the reload builds the kernel itself."""
        async def stage(e: Engine) -> dict[str, float]:
            if self.retie_supported is False:
                return {}
            t0 = time.perf_counter()
            try:
                started = _rpc_results(await self._step(e, "stage", "/collective_rpc", {
                    "method": "agentrl_stage_head", "kwargs": {"weights_path": weights_path}}))
                if not any(r.get("started") for r in started):
                    return {}
                deadline = t0 + self.step_timeouts_s["stage"]
                while time.perf_counter() < deadline:
                    await asyncio.sleep(0.02)
                    states = _rpc_results(await self._step(e, "stage", "/collective_rpc",
                                                           {"method": "agentrl_head_staged"}))
                    if states and all(st.get("ready") for st in states):
                        return {"stage_s": time.perf_counter() - t0,
                                "stage_worker_s": max(float(st.get("seconds", 0.0)) for st in states)}
                log.warning("%s: the tied head was not staged within %g s; the reload builds it",
                            e.name, self.step_timeouts_s["stage"])
            except EngineError as err:
                log.debug("%s: no tied head staged (%s); the reload builds it if there is one", e.name, err)
            return {"stage_s": time.perf_counter() - t0}

        return stage

    def _file_loader(self, weights_path: str) -> Any:
        """The load step of a file update. With the worker extension it is one RPC,
        ``agentrl_reload_weights`` (vLLM's reload, then the re-tie, timed inside the worker);
        without it, vLLM's ``reload_weights`` alone. Returns ``engine_reload_s`` (vLLM's reload
        alone), ``retie_s`` and ``reload_rpc_s`` (the whole load call as the pool saw it)."""
        async def reload(e: Engine) -> dict[str, float]:
            t0 = time.perf_counter()
            if self.retie_supported is not False:
                try:
                    text = await self._step(e, "reload", "/collective_rpc", {
                        "method": "agentrl_reload_weights", "kwargs": {"weights_path": weights_path}})
                except EngineError as err:
                    if self.retie_supported is not None:
                        raise
                    # The first engine asked: no extension, or a reload that failed. The plain
                    # path below tells which (it raises if the reload itself fails).
                    log.debug("%s: agentrl_reload_weights failed (%s); trying vLLM's reload_weights", e.name, err)
                else:
                    self.retie_supported = True
                    rpc_s = time.perf_counter() - t0
                    workers = _rpc_results(text) or [{}]  # the slowest worker decides
                    return {"reload_rpc_s": rpc_s,
                            "engine_reload_s": max(float(w.get("reload_s", rpc_s)) for w in workers),
                            "retie_s": max(float(w.get("retie_s", 0.0)) for w in workers),
                            "head_staged": all(w.get("head") == "staged" for w in workers)}
            t0 = time.perf_counter()
            await self._step(e, "reload", "/collective_rpc",
                             {"method": "reload_weights", "kwargs": {"weights_path": weights_path}})
            t1 = time.perf_counter()
            await self._retie(e)
            return {"reload_rpc_s": t1 - t0, "engine_reload_s": t1 - t0, "retie_s": time.perf_counter() - t1}

        return reload

    async def _retie(self, engine: Engine) -> None:
        """Point a tied LM head at the new embedding (see agentrl.weights.vllm_ext)."""
        if self.retie_supported is False:
            return
        try:
            await self._step(engine, "reload", "/collective_rpc", {"method": "agentrl_retie_word_embeddings"})
            self.retie_supported = True
        except EngineError as e:
            if self.retie_supported is None:  # the first engine asked has no extension
                self.retie_supported = False
                log.warning("engines lack --worker-extension-cls agentrl.weights.vllm_ext.WeightSyncExtension "
                            "(%s): a model with tied embeddings keeps its old LM head after each reload", e)
                return
            raise

    async def _resume(self, engine: Engine) -> bool:
        last: Exception | None = None
        for _ in range(self.resume_attempts):
            try:
                await self._step(engine, "resume", "/resume")
                return True
            except Exception as e:
                last = e
        log.error("could not resume %s: %s; taking it out of the pool", engine.name, last)
        self._mark_down(engine, f"resume failed: {last}")
        return False

    async def _update_all(self, version: int, targets: list[Engine], load: Any, timeout_s: float | None,
                          kind: str, stage: Any = None) -> dict[str, Any]:
        """Run the choreography on ``targets`` at once (caller holds the update lock)."""
        limit = timeout_s or self.step_timeouts_s["update"]
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(asyncio.wait_for(self._apply(e, version, load, stage), limit) for e in targets), return_exceptions=True)
        per_engine: dict[str, Any] = {}
        failed: list[str] = []
        for e, res in zip(targets, results, strict=True):
            if isinstance(res, BaseException):
                why = str(res) if isinstance(res, EngineError) else f"{type(res).__name__}: {res}"
                if isinstance(res, TimeoutError):
                    why = f"{e.name} ({e.url}): the update did not finish within {limit:g} s"
                self._mark_down(e, f"weight update to version {version} failed: {why}")
                e.last_error = why
                per_engine[e.name] = {"error": why, "url": e.url}
                failed.append(e.name)
            else:
                per_engine[e.name] = res
        if len(failed) == len(targets):
            from agentrl.weights.errors import WeightUpdateFailed

            raise WeightUpdateFailed(version, per_engine)
        if failed:
            log.error("version %d (%s): %s taken out of the pool: %s", version, kind, ", ".join(failed),
                      "; ".join(per_engine[n]["error"] for n in failed))
        self.version = version
        return {"version": version, "kind": kind, "engines": per_engine, "failed": failed,
                "update_s": time.perf_counter() - t0}

    async def update_weights(self, weights_path: str, version: int, timeout_s: float | None = None) -> dict[str, Any]:
        """Load ``weights_path`` into every healthy engine and stamp it ``version``.

        Updates serialise. Engines that fail are resumed, taken out of the pool and named in
        ``failed`` (the health checker re-adds them at the current version once they answer); the
        update succeeds if at least one engine took it, else :class:`WeightUpdateFailed` names
        every engine and why, and the pool stays at its previous version.
        """
        async with self._update_lock:
            self.updating = True
            try:
                targets = [e for e in self.engines if e.healthy]
                if not targets:
                    from agentrl.weights.errors import WeightUpdateFailed

                    raise WeightUpdateFailed(version, {e.name: {"error": e.last_error or "unhealthy", "url": e.url}
                                                       for e in self.engines})

                result = await self._update_all(version, targets, self._file_loader(weights_path), timeout_s, "file",
                                                self._head_stager(weights_path))
                self.weights_path = weights_path
                return result
            finally:
                self.updating = False

    async def init_weight_transfer(self, master_address: str, master_port: int, *, workers_per_engine: int = 1,
                                   packed: bool = True, packed_buffer_size_bytes: int | None = None,
                                   packed_num_buffers: int | None = None,
                                   world_size: int | None = None) -> dict[str, Any]:
        """Have every answering engine join the learner's NCCL weight-transfer group.

        The group is its own communicator (vLLM's stateless process group on ``master_port``), apart
        from any training process group. The learner is rank 0; engine ``i``'s workers take ranks
        ``1 + i * workers_per_engine ...``. The learner must open rank 0 while this call waits; if
        it expects a different ``world_size`` (an engine came or went), :class:`WeightGroupStale`.
        """
        from agentrl.weights.errors import WeightGroupStale, WeightUpdateFailed

        async with self._update_lock:
            members = [e for e in self.engines if await self._answers(e)]
            if not members:
                raise WeightUpdateFailed(0, {e.name: {"error": "does not answer /health", "url": e.url}
                                             for e in self.engines})
            world = 1 + len(members) * workers_per_engine
            if world_size is not None and world_size != world:
                raise WeightGroupStale(f"{len(members)} engines answer ({world} ranks), not {world_size} ranks")
            wire: dict[str, Any] = {"packed": packed}
            if packed_buffer_size_bytes is not None:
                wire["packed_buffer_size_bytes"] = packed_buffer_size_bytes
            if packed_num_buffers is not None:
                wire["packed_num_buffers"] = packed_num_buffers
            results = await asyncio.gather(*(
                self._step(e, "nccl_init", "/init_weight_transfer_engine", {"init_info": {
                    "master_address": master_address, "master_port": master_port,
                    "rank_offset": 1 + i * workers_per_engine, "world_size": world, **wire}})
                for i, e in enumerate(members)), return_exceptions=True)
            errors = {e.name: {"error": str(r), "url": e.url} for e, r in zip(members, results, strict=True)
                      if isinstance(r, BaseException)}
            if errors:
                self.nccl_members = ()
                raise WeightUpdateFailed(0, errors, what="the NCCL weight-transfer group could not be formed")
            self.nccl_members = tuple(e.name for e in members)
            return {"world_size": world, "members": list(self.nccl_members)}

    async def update_weights_nccl(self, version: int, update_info: dict[str, Any],
                                  timeout_s: float | None = None) -> dict[str, Any]:
        """Receive ``version`` over the NCCL group while the learner broadcasts it (packed buckets).

        Every member must take part (a broadcast to a missing rank would hang), so if the group's
        membership no longer matches the engines, this raises :class:`WeightGroupStale` before
        touching any engine and the learner re-forms the group.
        """
        from agentrl.weights.errors import WeightGroupStale

        async with self._update_lock:
            self.updating = True
            try:
                by_name = {e.name: e for e in self.engines}
                members = [by_name[n] for n in self.nccl_members]
                if not members:
                    raise WeightGroupStale("no NCCL weight-transfer group: call init first")
                gone = [e.name for e in members if not e.healthy and not await self._answers(e)]
                if gone:
                    raise WeightGroupStale(f"engines {gone} left the NCCL weight-transfer group; re-form it")

                async def receive(e: Engine) -> None:
                    await self._step(e, "nccl_start", "/start_weight_update")
                    await self._step(e, "nccl_transfer", "/update_weights", {"update_info": update_info})
                    await self._step(e, "nccl_finish", "/finish_weight_update", {})
                    await self._retie(e)

                result = await self._update_all(version, members, receive, timeout_s, "nccl")
                if result["failed"]:
                    self.nccl_members = ()  # the communicator is unusable once a rank failed mid-collective
                for e in members:
                    if e.name not in result["failed"]:
                        e.healthy = True  # a member that answered but had been out now serves this version
                self.weights_path = None  # nothing on disk holds this version
                return result
            finally:
                self.updating = False

    async def _answers(self, engine: Engine) -> bool:
        assert self._http is not None
        try:
            async with self._http.get(engine.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    def status(self) -> list[dict[str, Any]]:
        return [e.status() for e in self.engines]


_JSON = {"Content-Type": "application/json"}


try:  # orjson when installed (several times faster on the hot path), else the standard library
    import orjson

    def dumps(body: Any) -> bytes:
        return orjson.dumps(body)

    loads = orjson.loads
except ImportError:
    def dumps(body: Any) -> bytes:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()

    loads = json.loads


def _engine_message(text: str) -> str:
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:1000]
    return str(err)[:1000]
