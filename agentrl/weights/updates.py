"""Serve's side of weight sync: bringing an engine pool's engines to a policy version.

Role: the choreography every update runs on each engine (stage -> pause(keep) -> load -> reset the
prefix cache and stamp the version -> resume), its load steps (a file reload followed by the tied
LM head's re-tie; an NCCL receive), forming the NCCL weight-transfer group, and bringing an engine
that was out back to the current version. :class:`EngineUpdater` works over an
:class:`~agentrl.engines.pool.EnginePool` through the pool's public calls (``control``, ``answers``,
``mark_down``) and installs itself as the pool's ``on_rejoin`` hook: the router never imports
this package. serve's :class:`~agentrl.weights.transfer.WeightReceiver` drives it. A LoRA policy's
versions take another path (:meth:`EngineUpdater.load_adapter`): each is loaded as its own adapter
beside the last ``adapter_keep`` with no pause (nothing in an engine changes under a request),
and a version a role is pinned to (``pinned``) stays loaded whatever comes after.
Several named policies (multi-LoRA) each have their own adapters, versions and kept window
(:meth:`EngineUpdater.policy` is one policy's view, which its weight receiver drives).

Invariants:
- Updates and rejoins serialise on one lock. ``pool.version`` moves to a version only once at
  least one engine took it; otherwise :class:`WeightUpdateFailed` names every engine and why.
- Every step has its own limit (``step_timeouts_s``) and each engine's whole update one more
  (``update``): an update ends in bounded time whatever the engines do.
- An engine is never left paused: resume runs in a shielded ``finally``, even when the pause
  itself timed out, ``resume_attempts`` times; an engine that still cannot be resumed is taken out.
- An engine that fails is taken out of the pool and named with its error; its peers finish.
- An engine that answers again is reloaded with the current weights before it takes traffic
  (it may have restarted with its base weights); a version that exists only in the NCCL group
  keeps it out until the learner re-forms the group.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from agentrl.engines.errors import EngineError
from agentrl.engines.pool import DEFAULT_POLICY, Engine, EnginePool, adapter_name
from agentrl.weights.errors import WeightGroupStale, WeightUpdateFailed

log = logging.getLogger(__name__)

# One engine's part of an update, before the pause (stage) or inside it (load); each returns its
# timings, which end up in that engine's entry of the update's result.
Stage = Callable[[Engine], Awaitable[dict[str, Any]]]
Load = Callable[[Engine], Awaitable[dict[str, Any] | None]]


def _rpc_results(text: str) -> list[dict[str, Any]]:
    """The workers' answers in a ``/collective_rpc`` response (``{"results": [...]}``) that are objects."""
    try:
        results = json.loads(text).get("results") or []
    except (ValueError, AttributeError):
        return []
    return [r for r in results if isinstance(r, dict)]


class EngineUpdater:
    """Loads versions into a pool's engines, one update at a time (see the module's invariants)."""

    # Every step of an update has its own limit (seconds); override per updater with
    # ``updater.step_timeouts_s = dict(updater.step_timeouts_s, reload=...)``. ``update`` bounds
    # one engine's whole choreography, ``nccl_init`` the NCCL rendezvous.
    step_timeouts_s: dict[str, float] = {  # noqa: RUF012 - replaced, never mutated in place
        "stage": 60.0, "pause": 30.0, "reload": 300.0, "reset": 30.0, "version": 30.0, "resume": 10.0,
        "nccl_init": 120.0, "nccl_start": 30.0, "nccl_transfer": 300.0, "nccl_finish": 60.0, "update": 600.0,
        "adapter_load": 120.0, "adapter_unload": 30.0,
    }
    resume_attempts: int = 3

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        # The folder of the current version, which a returning engine reloads; None when the
        # current version is on no disk (the engines' base weights at 0, or an NCCL version).
        self.weights_path: str | None = None
        self.updating = False
        # Engines started with agentrl.weights.vllm_ext re-tie a tied LM head after each load
        # (vLLM's reload leaves the old one); None until the first engine says whether it has it.
        self.retie_supported: bool | None = None
        # engine names in the NCCL weight-transfer group, in rank order
        self.nccl_members: tuple[str, ...] = ()
        # LoRA policies: policy -> version -> adapter folder of the versions that stay loaded, and
        # how many do (the policy's staleness bound + 1: a request finishes on the adapter it began
        # on); the default policy's version is the pool's ``version``, every named one's in ``pool.versions``
        self.adapters: dict[str, dict[int, str]] = {}
        self.adapter_keep = 2
        self.keep: dict[str, int] = {}  # a named policy's own window (default: adapter_keep)
        # policy -> versions a role plays at (env.roles.<role>.version): once published, loaded
        # beside the window whatever comes after, and into every engine that rejoins
        self.pinned: dict[str, set[int]] = {}
        self.default_policy = DEFAULT_POLICY
        self._lock = asyncio.Lock()
        pool.on_rejoin = self.rejoin

    @property
    def version(self) -> int:
        """The version the pool's engines serve (the pool keeps it: the router reports it)."""
        return self.pool.version

    async def start(self) -> None:
        """Stamp every engine with the pool's version, so the tokens they generate carry it."""
        await asyncio.gather(*(self._set_version(e, self.pool.version) for e in self.pool.engines),
                             return_exceptions=True)

    # -- one engine ------------------------------------------------------------------------------
    async def _step(self, engine: Engine, step: str, path: str, body: dict | None = None,
                    params: dict | None = None) -> str:
        """One control call of an update, bounded by its own timeout; errors name the engine and step."""
        limit = self.step_timeouts_s[step]
        try:
            return await asyncio.wait_for(
                self.pool.control(engine, path, body, params, timeout_s=limit), limit + 1.0
            )
        except TimeoutError as e:
            raise EngineError(
                f"{engine.name} ({engine.url}): step {step!r} ({path}) timed out after {limit:g} s"
            ) from e
        except aiohttp.ClientError as e:
            raise EngineError(
                f"{engine.name} ({engine.url}): step {step!r} ({path}) failed: {type(e).__name__}: {e}"
            ) from e

    async def _set_version(self, engine: Engine, version: int) -> None:
        await self._step(engine, "version", "/update_weight_version", {"new_version": str(version)})
        engine.version = version

    async def _apply(
        self, engine: Engine, version: int, load: Load, stage: Stage | None = None
    ) -> dict[str, Any]:
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
                raise EngineError(f"{engine.name} could not reset its prefix "
                                  f"cache after the reload: {str(reset)[:200]}")
        finally:
            # Never leave an engine paused: resume even if a step failed or we were cancelled.
            resumed = await asyncio.shield(self._resume(engine))
        if not resumed:
            raise EngineError(f"{engine.name} ({engine.url}) loaded "
                              f"version {version} but could not be resumed")
        t_resumed = time.perf_counter()
        # The clock readings too (time.perf_counter, this process), so a caller can line them up
        # with what clients saw.
        return {"pause_s": t_paused - t0, "reload_s": t_loaded - t_paused,
                "pause_window_s": t_resumed - t_paused, "total_s": t_resumed - t0,
                "t_pause_sent": t0, "t_paused": t_paused, "t_resumed": t_resumed, **staged, **parts}

    async def _resume(self, engine: Engine) -> bool:
        last: Exception | None = None
        for _ in range(self.resume_attempts):
            try:
                await self._step(engine, "resume", "/resume")
                return True
            except Exception as e:
                last = e
        log.error("could not resume %s: %s; taking it out of the pool", engine.name, last)
        self.pool.mark_down(engine, f"resume failed: {last}")
        return False

    async def _update_one(self, engine: Engine, weights_path: str, version: int) -> dict[str, Any]:
        return await self._apply(
            engine, version, self._file_loader(weights_path), self._head_stager(weights_path)
        )

    # -- the file path's stage and load steps ------------------------------------------------------
    def _head_stager(self, weights_path: str) -> Stage:
        """The step before the pause of a file update: the engine builds its tied LM head's kernel
        from the new embedding while it keeps generating (agentrl.weights.vllm_ext), and this waits
        until it is built, so the reload in the pause swaps it in instead of building it. Returns
        ``stage_s`` (as the updater saw it) and ``stage_worker_s`` (the build in the worker).
        Engines without the extension, or models without a tied head, cost one call; if it fails
        or takes longer than ``step_timeouts_s["stage"]``, the reload builds the kernel itself."""
        async def stage(e: Engine) -> dict[str, Any]:
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

    def _file_loader(self, weights_path: str) -> Load:
        """The load step of a file update. With the worker extension it is one RPC,
        ``agentrl_reload_weights`` (vLLM's reload, then the re-tie, timed inside the worker);
        without it, vLLM's ``reload_weights`` alone. Returns ``engine_reload_s`` (vLLM's reload
        alone), ``retie_s`` and ``reload_rpc_s`` (the whole load call as the updater saw it)."""
        async def reload(e: Engine) -> dict[str, Any]:
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
                    log.debug(
                        "%s: agentrl_reload_weights failed (%s); trying vLLM's reload_weights", e.name, err
                    )
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
                log.warning("engines lack --worker-extension-cls "
                            "agentrl.weights.vllm_ext.WeightSyncExtension (%s): a "
                            "model with tied embeddings keeps its old LM head after each reload", e)
                return
            raise

    # -- all engines -----------------------------------------------------------------------------
    async def _update_all(self, version: int, targets: list[Engine], load: Load, timeout_s: float | None,
                          kind: str, stage: Stage | None = None) -> dict[str, Any]:
        """Run the choreography on ``targets`` at once (caller holds the lock).

        The one place a version becomes the pool's: any engine transport (a file, an NCCL
        receive, a delta to apply) is a ``load`` step, and optionally a ``stage`` step, run here.
        """
        t0 = time.perf_counter()
        per_engine, failed = await self._on_each(targets, version, kind, timeout_s,
                                                 lambda e: self._apply(e, version, load, stage))
        self.pool.version = version
        return {"version": version, "kind": kind, "engines": per_engine, "failed": failed,
                "update_s": time.perf_counter() - t0}

    async def _on_each(self, targets: list[Engine], version: int, kind: str, timeout_s: float | None,
                       one: Callable[[Engine], Awaitable[Any]]) -> tuple[dict[str, Any], list[str]]:
        """``await one(engine)`` on every target at once, each bounded by ``timeout_s`` (default
        ``step_timeouts_s["update"]``): (each engine's result or error, the names of those that
        failed, which are taken out of the pool). Raises :class:`WeightUpdateFailed` when all failed."""
        limit = timeout_s or self.step_timeouts_s["update"]
        results = await asyncio.gather(
            *(asyncio.wait_for(one(e), limit) for e in targets), return_exceptions=True
        )
        per_engine: dict[str, Any] = {}
        failed: list[str] = []
        for e, res in zip(targets, results, strict=True):
            if isinstance(res, BaseException):
                why = str(res) if isinstance(res, EngineError) else f"{type(res).__name__}: {res}"
                if isinstance(res, TimeoutError):
                    why = f"{e.name} ({e.url}): the update did not finish within {limit:g} s"
                self.pool.mark_down(e, f"weight update to version {version} ({kind}) failed: {why}")
                e.last_error = why
                per_engine[e.name] = {"error": why, "url": e.url}
                failed.append(e.name)
            else:
                per_engine[e.name] = res
        if len(failed) == len(targets):
            raise WeightUpdateFailed(version, per_engine)
        if failed:
            log.error("version %d (%s): %s taken out of the pool: %s", version, kind, ", ".join(failed),
                      "; ".join(per_engine[n]["error"] for n in failed))
        return per_engine, failed

    def _targets(self, version: int) -> list[Engine]:
        """The healthy engines an update goes to; none: :class:`WeightUpdateFailed` naming every engine."""
        targets = [e for e in self.pool.engines if e.healthy]
        if not targets:
            raise WeightUpdateFailed(version, {e.name: {"error": e.last_error or "unhealthy", "url": e.url}
                                               for e in self.pool.engines})
        return targets

    async def update_weights(
        self, weights_path: str, version: int, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Load ``weights_path`` into every healthy engine and stamp it ``version``.

        Updates serialise. Engines that fail are resumed, taken out of the pool and named in
        ``failed`` (the health checker re-adds them at the current version once they answer); the
        update succeeds if at least one engine took it, else :class:`WeightUpdateFailed` names
        every engine and why, and the pool stays at its previous version.
        """
        async with self._lock:
            self.updating = True
            try:
                targets = self._targets(version)
                result = await self._update_all(
                    version,
                    targets,
                    self._file_loader(weights_path),
                    timeout_s,
                    "file",
                    self._head_stager(weights_path),
                )
                self.weights_path = weights_path
                return result
            finally:
                self.updating = False

    async def init_weight_transfer(
        self,
        master_address: str,
        master_port: int,
        *,
        workers_per_engine: int = 1,
        packed: bool = True,
        packed_buffer_size_bytes: int | None = None,
        packed_num_buffers: int | None = None,
        world_size: int | None = None,
    ) -> dict[str, Any]:
        """Have every answering engine join the learner's NCCL weight-transfer group.

        The group is its own communicator (vLLM's stateless process group on ``master_port``), apart
        from any training process group. The learner is rank 0; engine ``i``'s workers take ranks
        ``1 + i * workers_per_engine ...``. The learner must open rank 0 while this call waits; if
        it expects a different ``world_size`` (an engine came or went), :class:`WeightGroupStale`.
        """
        async with self._lock:
            members = [e for e in self.pool.engines if await self.pool.answers(e)]
            if not members:
                raise WeightUpdateFailed(0, {e.name: {"error": "does not answer /health", "url": e.url}
                                             for e in self.pool.engines})
            world = 1 + len(members) * workers_per_engine
            if world_size is not None and world_size != world:
                raise WeightGroupStale(f"{len(members)} engines answer ({world} "
                                       f"ranks), not {world_size} ranks")
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
        async with self._lock:
            self.updating = True
            try:
                by_name = {e.name: e for e in self.pool.engines}
                members = [by_name[n] for n in self.nccl_members]
                if not members:
                    raise WeightGroupStale("no NCCL weight-transfer group: call init first")
                gone = [e.name for e in members if not e.healthy and not await self.pool.answers(e)]
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

    # -- LoRA adapters ---------------------------------------------------------------------------
    def policy(self, name: str) -> PolicyUpdater:
        """Policy ``name``'s view of this updater: what its weight receiver drives."""
        return PolicyUpdater(self, name)

    def policy_version(self, policy: str) -> int:
        if policy == self.default_policy:
            return self.pool.version
        return self.pool.versions.get(policy, 0)

    def keep_of(self, policy: str) -> int:
        return self.keep.get(policy, self.adapter_keep)

    async def _load_adapter_into(self, engine: Engine, policy: str, version: int, path: str) -> float:
        """Load one adapter version into ``engine`` under its own name (no pause: requests on other
        versions go on, and a request is only ever sent to an adapter that is loaded)."""
        t0 = time.perf_counter()
        try:
            await self._step(engine, "adapter_load", "/v1/load_lora_adapter",
                             {"lora_name": adapter_name(version, policy), "lora_path": path})
        except EngineError as e:
            if "answered 404" in str(e) or "answered 405" in str(e):
                raise EngineError(
                    f"{engine.name} has no LoRA adapter routes: serve's engines need LoRA on "
                    f"(engine.lora_rank >= the adapter's rank) to take adapter versions ({e})"
                ) from e
            raise
        engine.adapters.setdefault(policy, {})[version] = path
        if policy == self.default_policy:
            engine.version = max(engine.adapters[policy])
        return time.perf_counter() - t0

    async def _unload_old_adapters(self, engine: Engine, policy: str) -> list[int]:
        """Unload ``policy``'s adapters of ``engine`` outside its kept window. vLLM's unload only
        stops new requests from naming it; requests under way finish on it."""
        kept = self.adapters.get(policy, {})
        held = engine.adapters.get(policy, {})
        gone = [v for v in held if v not in kept]
        for v in gone:
            try:
                await self._step(engine, "adapter_unload", "/v1/unload_lora_adapter",
                                 {"lora_name": adapter_name(v, policy)})
            except EngineError as e:
                log.warning("%s: unloading adapter %s failed (%s); it stays until the engine restarts",
                            engine.name, adapter_name(v, policy), e)
            held.pop(v, None)
        return gone

    async def load_adapter(self, path: str, version: int, timeout_s: float | None = None,
                           policy: str | None = None) -> dict[str, Any]:
        """Load LoRA adapter ``path`` into every healthy engine as ``policy``'s ``version`` (the
        default policy's when None): new calls of that policy go to it as soon as an engine has
        it, calls under way finish on theirs, and the policy's versions older than its newest
        ``keep_of(policy)`` are unloaded, but for its ``pinned`` ones. Fails like :meth:`update_weights`."""
        policy = policy or self.default_policy
        async with self._lock:
            self.updating = True
            try:
                targets = self._targets(version)
                t0 = time.perf_counter()

                async def one(e: Engine) -> dict[str, Any]:
                    return {"adapter_load_s": await self._load_adapter_into(e, policy, version, path)}

                per_engine, failed = await self._on_each(targets, version, "adapter", timeout_s, one)
                kept = self.adapters.setdefault(policy, {})
                kept[version] = path
                pinned = self.pinned.get(policy, set())
                for v in sorted(kept)[:-self.keep_of(policy)]:
                    if v not in pinned:
                        del kept[v]
                if policy == self.default_policy:
                    self.pool.version = version
                    self.weights_path = path
                else:
                    self.pool.versions[policy] = version
                for e in targets:
                    if e.name not in failed:
                        per_engine[e.name]["unloaded"] = await self._unload_old_adapters(e, policy)
                return {"version": version, "kind": "adapter", "policy": policy, "engines": per_engine,
                        "failed": failed, "update_s": time.perf_counter() - t0, "loaded": sorted(kept)}
            finally:
                self.updating = False

    # -- an engine that was out ------------------------------------------------------------------
    async def rejoin(self, engine: Engine) -> bool:
        """The pool's ``on_rejoin`` hook: bring an engine that answers again to the current version.

        True: it may take traffic. False: it stays out until a later health check (an update is
        under way, the version exists only in the NCCL group, or the reload failed).
        """
        if self.updating:  # the update under way decides; the next check tries again
            return False
        async with self._lock:
            version = self.pool.version
            # The process may have restarted with its base weights, whatever version it last
            # reported: reload the current weights before it takes traffic.
            try:
                if self.adapters:  # LoRA policies: every kept adapter, so the engine serves the current ones
                    engine.adapters.clear()
                    for policy, kept in self.adapters.items():
                        for v, path in sorted(kept.items()):
                            await self._load_adapter_into(engine, policy, v, path)
                    await self._set_version(engine, version)
                elif self.weights_path:
                    await self._update_one(engine, self.weights_path, version)
                elif version == 0:
                    await self._set_version(engine, version)
                else:  # NCCL-only versions are on no disk: it waits for the group to be re-formed
                    log.warning("%s answered but version %d exists only in the NCCL group; it stays out "
                                "until the learner re-forms the group", engine.name, version)
                    return False
            except Exception as e:
                engine.failed_rejoins += 1  # serve's supervisor relaunches an engine that keeps failing
                engine.last_error = f"could not be brought to version {version}: {e or type(e).__name__}"
                log.warning("%s answered but could not be brought to version %d (%d time(s) in a row): %s",
                            engine.name, version, engine.failed_rejoins, e)
                return False
        engine.failed_rejoins = 0
        return True


class PolicyUpdater:
    """One named policy's view of an :class:`EngineUpdater`, with the surface a
    :class:`~agentrl.weights.transfer.WeightReceiver` drives (``version``, ``weights_path``,
    ``adapters``, ``adapter_keep``, ``load_adapter``): each policy's receiver uploads and loads only
    its own adapters. A policy's versions are adapters only: a full-weight update is refused."""

    def __init__(self, updater: EngineUpdater, policy: str) -> None:
        self.updater = updater
        self.name = policy

    @property
    def version(self) -> int:
        return self.updater.policy_version(self.name)

    @property
    def weights_path(self) -> str | None:
        kept = self.updater.adapters.get(self.name) or {}
        return kept[max(kept)] if kept else None

    @property
    def adapters(self) -> dict[int, str]:
        return self.updater.adapters.get(self.name) or {}

    @property
    def adapter_keep(self) -> int:
        return self.updater.keep_of(self.name)

    async def load_adapter(self, path: str, version: int, timeout_s: float | None = None) -> dict[str, Any]:
        return await self.updater.load_adapter(path, version, timeout_s, policy=self.name)

    async def update_weights(
        self, weights_path: str, version: int, timeout_s: float | None = None
    ) -> dict[str, Any]:
        raise ValueError(f"policy {self.name!r} is a LoRA policy: its versions are adapters "
                         "(weights.transport.kind = \"adapter\"), not full weights")
