"""``agentrl serve``: engines, router, sandboxes, buffer and agent loops in one process.

Start-up order: the user's code and the scaffold (a bad one fails first) -> model folder -> engines
(child processes, or Ray actors with ``ray.address``, or running ones at ``engine.urls``) -> engine
pool -> router -> buffer (recovered from disk) -> HTTP -> sandbox pool and orchestrator (or, under
Ray, the rollout workers; nothing with ``endpoint_only``). Every part comes from
:mod:`agentrl.serve.build`. While the engines start, the router's port already answers: ``/health``
with 503 and the start-up phase, ``/admin/status`` with the phase of each engine, so neither a
person nor ``agentrl run`` waits in silence. Shutdown runs in reverse and always stops the engines
and removes this instance's containers; a stop during start-up (Ctrl-C) stops what was started.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import logging
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentrl._lazy import import_ahead
from agentrl.buffer.disk import append_line
from agentrl.credentials import find_api_keys, settle_admin_token
from agentrl.serve.config import ServeConfig, redacted
from agentrl.web import listen_when_free

if TYPE_CHECKING:
    from agentrl.buffer import Buffer, PolicyBuffers
    from agentrl.engines.vllm import VLLMEngine
    from agentrl.rollout.orchestrator import Orchestrator
    from agentrl.router import EnginePool, Router
    from agentrl.sandbox.attach import ImagePools
    from agentrl.sandbox.pool import SandboxPool
    from agentrl.serve.local import LocalEngines
    from agentrl.serve.ray import RayCluster
    from agentrl.serve.routers import RouterProcesses
    from agentrl.serve.teacher_engine import TeacherEngine
    from agentrl.view.routes import ViewState
    from agentrl.weights import EngineUpdater, WeightReceiver

log = logging.getLogger(__name__)
_progress = logging.getLogger("agentrl.progress")

# serve's collector thresholds (see settle_gc)
GC_THRESHOLD = (50_000, 50, 100)


def settle_gc() -> None:
    """What serve does to Python's garbage collector once it is up (benchmarks/router_overhead.py
    measures with it, and benchmarks/agent_loops.py with ``--gc thresholds``). The pacer
    (:class:`~agentrl.serve.collector.GcPacer`, ``--gc pacer`` there) is not serve's: its whole-heap
    passes while the heap grows stalled the loop 2.4-11.9 s at 20,000-50,000 episodes, which in
    serve would hold every router call and health check that long.

    - Start-up's objects (tokenizer, chat template, imported modules: about 365k) are frozen out of
      the collector's generations, so its passes over the hot path's garbage stay short (the
      router's CPU per completion fell about 15% in benchmarks/router_overhead.py).
    - Higher thresholds: thousands of live episodes hold many small objects, and with the default
      thresholds a full collection stalled the event loop for up to a second
      (benchmarks/agent_loops.py).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def weights_cap(model_path: str) -> int:
    """The largest weight upload serve takes: four times the model folder's weight files (a full
    fp32 copy of a bf16 model fits), at least 1 GiB; a hub name (no folder) allows 64 GiB."""
    folder = Path(model_path)
    if not folder.is_dir():
        return 64 << 30
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt"))
    return max(1 << 30, 4 * size)


class Serve:
    """One serve process. Its parts are None until ``start`` has built them (in the order of the
    module doc); ``close`` stops those that were built, so a start that failed half way cleans up."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.admin_token = ""
        self.api_keys: frozenset[str] = frozenset()
        self.view: ViewState | None = None
        self.model_path: str | None = None  # the model's folder, once resolved
        self.engine_key = ""  # the key of the engines serve launches ("" for engine.urls)
        self.local: LocalEngines | None = None  # when serve launched its engines
        self.pool: EnginePool | None = None
        self.updater: EngineUpdater | None = None
        self.router: Router | None = None
        # None also when the environment needs no sandbox
        self.sandbox_pool: SandboxPool | ImagePools | None = None
        self.buffer: Buffer | PolicyBuffers | None = None
        self.weights: WeightReceiver | None = None  # the default policy's uploads
        self.policy_weights: dict[str, WeightReceiver] = {}  # named LoRA policies: policy -> its receiver
        self.orchestrator: Orchestrator | None = None  # the agent loops here; None under Ray (workers play)
        self.cluster: RayCluster | None = None  # with ray.address
        self.teacher_engine: TeacherEngine | None = None  # a teacher serve launches
        self.routers: RouterProcesses | None = None  # router.processes > 1: the other router processes
        self._runner: web.AppRunner | None = None
        self._rollout_task: asyncio.Task | None = None
        self._metrics_task: asyncio.Task | None = None
        self._starting: web.AppRunner | None = None  # the start-up status app, until the real one runs
        self._listener: socket.socket | None = None  # the router's port, one socket for both apps
        self.phase = "starting"
        self.started = time.time()

    @property
    def url(self) -> str:
        return f"http://{self.cfg.router.host}:{self.cfg.router.port}"

    @property
    def engines(self) -> list[VLLMEngine]:
        """The engine processes serve launched (none with ``engine.urls`` or under Ray)."""
        return self.local.engines if self.local is not None else []

    async def start(self) -> None:
        from agentrl.models import is_moe, resolve_model
        from agentrl.serve import build
        from agentrl.weights import EngineUpdater

        cfg = self.cfg
        build.import_user_code(cfg)  # the user's environments, before anything looks them up
        build.sandbox_image(cfg)  # an unknown environment fails here, before engines start
        scaffold = build.load_scaffold_of(cfg)  # a scaffold that cannot be loaded fails before engines start
        if scaffold is not None:
            log.info("episodes are played by the scaffold %s", getattr(cfg.scaffold, cfg.scaffold.kind))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.admin_token = settle_admin_token(cfg.admin_token, cfg.admin_token_file, self.run_dir)
        self.api_keys = frozenset(find_api_keys(cfg.router.api_keys, cfg.router.api_keys_file))
        (self.run_dir / "serve_config.json").write_text(json.dumps(redacted(cfg), indent=2))
        from agentrl.view import serve_view

        # the read-only web view, on the start-up app and the real one (the model folder once known)
        self.view = serve_view(self.run_dir, self.admin_token, lambda: self.model_path)
        await self._serve_startup_status()
        self._phase(f"preparing the model {cfg.model}")
        self.model_path = await asyncio.to_thread(resolve_model, cfg.model)
        import_ahead("transformers", "AutoTokenizer")  # the router's tokenizer stack, while the engines start

        urls = list(cfg.engine.urls)
        # engines serve launches answer only serve (a key per run); running ones (engine.urls) are theirs
        self.engine_key = "" if urls else build.engine_key()
        if cfg.ray.address:  # rollout workers, and the engines unless engine.urls names them, as Ray actors
            from agentrl.serve.ray import RayCluster

            self.cluster = RayCluster(cfg, self.model_path, self.run_dir, engine_key=self.engine_key)
            if urls:
                await self.cluster.connect()
            else:
                self._phase(f"starting {cfg.engine.count} engine actor(s) on the Ray cluster")
                urls = await self.cluster.start_engines()
        if not urls:
            from agentrl.serve.local import LocalEngines

            self.local = LocalEngines(
                build.engine_specs(cfg, self.model_path, self.engine_key), self.run_dir / "logs"
            )
            await self.local.wait_ports_free()  # an engine of a serve killed just now may still hold one
            self.local.launch()  # from this (main) thread: the reaper dies with us
            self._phase(f"starting {cfg.engine.count} engine(s)")
            urls = await self.local.start(cfg.engine.start_timeout_s, cfg.engine.max_restarts)
        self._phase("connecting to the engines")
        self.pool = build.build_pool(cfg, urls, self.engine_key)
        await self.pool.start()
        self.updater = EngineUpdater(self.pool)  # brings engines to a version; rejoins through pool.on_rejoin
        # LoRA policies: the versions a sample may still be drawn from stay loaded as adapters
        # (and those a role plays against some versions back: env.roles.<role>.lag)
        windows = cfg.adapter_windows()
        self.updater.adapter_keep = windows.get("", cfg.buffer.max_staleness + 1)
        staleness = cfg.staleness()
        if staleness:  # named policies (multi-LoRA): each its own versions and window
            self.updater.default_policy = next(iter(cfg.policies))
            self.updater.keep = windows
        # and the versions roles play at (env.roles.<role>.version), once published, whatever comes after
        pins = cfg.pinned_versions()
        self.updater.pinned = {name or self.updater.default_policy: set(vs) for name, vs in pins.items()}
        await self.updater.start()  # stamps the engines with the pool's version
        if self.local is not None:  # a dead engine is relaunched and rejoins at the current version
            self.local.supervise(self.pool, build.restart_policy(cfg))
        lag, teacher_cfg = cfg.scoring.teacher.lag, cfg.scoring.teacher
        if (
            lag or teacher_cfg.launched
        ):  # one more engine: the student some versions back, or a model of its own
            if self.local is None:
                from agentrl.errors import ConfigError

                raise ConfigError("a teacher serve launches (scoring.teacher.lag, or "
                                  "scoring.teacher.model without a url) needs the engines "
                                  "serve launches itself: not engine.urls, not ray.address")
            from agentrl.serve.teacher_engine import TeacherEngine, check_same_tokenizer

            teacher_path = self.model_path
            if teacher_cfg.launched:
                teacher_path = await asyncio.to_thread(resolve_model, teacher_cfg.model)
                await asyncio.to_thread(check_same_tokenizer, self.model_path, teacher_path)
            self.teacher_engine = TeacherEngine(cfg, teacher_path, self.engine_key, self.run_dir / "logs")
            self._phase(
                f"starting the self-distillation teacher's engine (the policy {lag} version(s) back)"
                if lag
                else f"starting the teacher's engine ({teacher_cfg.model})"
            )
            await self.teacher_engine.start(cfg.engine.start_timeout_s)
        self.router = build.build_router(cfg, self.pool, self.model_path, self.run_dir)
        if is_moe(self.model_path):  # the learner replays the experts the engines routed each token through
            await self.router.capture_experts()
        self.buffer = build.build_buffer(cfg, self.run_dir)
        from agentrl.weights import WeightReceiver

        # the teacher loads a version up to lag + every - 1 back
        keep = max(2, lag + cfg.scoring.teacher.every)
        # named policies: one receiver each (weights/<policy>/v<N>, adapters only); the first is the default
        self.policy_weights = {
            name: WeightReceiver(
                self.run_dir / "weights" / name,
                self.updater.policy(name),
                keep=keep,
                max_bytes=weights_cap(self.model_path),
                adapters_only=True,
                pinned=pins.get(name, ()),
            )
            for name in staleness
        }
        self.weights = (
            self.policy_weights[self.updater.default_policy]
            if staleness
            else WeightReceiver(
                self.run_dir / "weights", self.updater, keep=keep, max_bytes=weights_cap(self.model_path),
                pinned=pins.get("", ()),
            )
        )
        for name, receiver in (self.policy_weights or {"": self.weights}).items():
            latest = receiver.latest_loaded()
            if (
                cfg.restore and latest is not None and latest[0] > receiver.updater.version
            ):  # a restart: carry on
                self._phase(f"restoring {f'policy {name} ' if name else 'policy '}version "
                            f"{latest[0]} from {latest[1]}")
                for pinned in receiver.pinned_loaded(below=latest[0]):  # a role plays at it: loaded first
                    await receiver.restore(*pinned)
                await receiver.restore(*latest)
        teacher = None
        if self.teacher_engine is not None:
            from agentrl.scoring.teacher import Teacher

            st, root = self.teacher_engine, self.run_dir / "weights"
            if st.follows:
                self.weights.on_loaded.append(lambda version: st.advance(version, root))
                await st.advance(self.pool.version, root)  # a restarted serve: the teacher of its version
            teacher = Teacher(
                cfg.scoring.teacher,
                timeout_s=cfg.scoring.timeout_s,
                retries=cfg.scoring.retries,
                url=f"{st.url}/v1",
                key=self.engine_key,
                version=(lambda: st.version) if st.follows else None,
            )
        await self._serve_http()

        if cfg.endpoint_only:
            log.info(
                "endpoint only: no agent loops; external clients' sessions at %s/sessions/<id>/v1", self.url
            )
        elif self.cluster is not None:  # the rollout workers on the cluster play the episodes
            from agentrl.serve.ray import default_serve_url

            self._rollout_task = asyncio.create_task(
                self.cluster.run_workers(default_serve_url(cfg), self.admin_token, self.pool),
                name="rollout-workers",
            )
        else:
            self.sandbox_pool = await build.build_sandbox_pool(cfg, "serve")
            # with several router processes, serve's own sessions are reached on a port of its own
            router_url = await self.routers.private_site(self._runner) if self.routers and scaffold else ""
            producer = build.build_producer(cfg, self.router, self.sandbox_pool, scaffold=scaffold,
                                            router_url=router_url)
            # scoring.judge.engine: the judge is the policy on serve's first engine, asked there directly
            judge = (
                (f"{self.pool.engines[0].url}/v1", self.engine_key, cfg.model)
                if cfg.scoring.judge.engine
                else None
            )
            self.orchestrator = build.build_orchestrator(
                cfg,
                producer,
                self.buffer,
                run_dir=self.run_dir,
                policy_version=lambda: self.pool.version,
                teacher=teacher,
                judge_endpoint=judge,
                engines=self.pool,
            )
            if self.orchestrator.concurrency is not None:
                self.orchestrator.concurrency.start()
            self._rollout_task = asyncio.create_task(self.orchestrator.run(), name="orchestrator")
        self.phase = "serving"
        settle_gc()
        self._metrics_task = asyncio.create_task(self._metrics_loop(), name="serve-metrics")

    def _phase(self, phase: str) -> None:
        self.phase = phase
        _progress.info("serve: %s (%.0f s)", phase, time.time() - self.started)

    def startup_status(self) -> dict[str, Any]:
        engines = [e.startup() for e in self.engines]
        return {"status": "starting", "phase": self.phase, "elapsed_s": round(time.time() - self.started, 1),
                "engines": engines}

    async def _serve_startup_status(self) -> None:
        """Answer on the router's port while the engines start: /health (503, the phase), /admin/status."""
        from agentrl.web import ADMIN_TOKEN, close_after_response, error_middleware, require_admin

        async def health(request: web.Request) -> web.Response:
            return web.json_response(self.startup_status(), status=503)

        async def status(request: web.Request) -> web.Response:
            require_admin(request)
            return web.json_response({"starting": True, **self.startup_status()})

        async def not_yet(request: web.Request) -> web.Response:  # retryable: come back when it is up
            return web.json_response(
                {
                    "error": {
                        "message": f"serve is starting ({self.phase})",
                        "type": "starting",
                        "param": None,
                        "code": "starting",
                    }
                },
                status=503,
                headers={"Retry-After": "2"},
            )

        # nobody keeps a connection to this page across its handover to the real routes
        app = web.Application(middlewares=[close_after_response, error_middleware])
        app[ADMIN_TOKEN] = self.admin_token
        app.router.add_get("/health", health)
        app.router.add_get("/admin/status", status)
        from agentrl.view import mount as mount_view

        mount_view(app, self.view)
        app.router.add_route("*", "/{tail:.*}", not_yet)
        self._starting = web.AppRunner(app, access_log=None)
        await self._starting.setup()
        self._listener = await listen_when_free(self.cfg.router.host, self.cfg.router.port)
        await web.SockSite(self._starting, self._listener.dup()).start()

    async def _serve_http(self) -> None:
        from agentrl.buffer import add_buffer_routes
        from agentrl.rollout.remote import episode_log_route
        from agentrl.router.server import METRICS_EXTRA, METRICS_OTHERS, make_app
        from agentrl.web import hand_over, require_admin

        app = make_app(self.router, admin_token=self.admin_token, api_keys=self.api_keys,
                       client_max_size=self.cfg.router.max_body_mb << 20)
        app[METRICS_EXTRA] = lambda: prometheus_series(self.status())
        add_buffer_routes(app, self.buffer, self.admin_token)
        self.weights.add_routes(app, require_admin)
        for name, receiver in self.policy_weights.items():  # named LoRA policies: each its own upload routes
            receiver.add_routes(app, require_admin, prefix=f"/admin/policies/{name}/weights")
        app.router.add_get("/admin/info", self._info)
        app.router.add_get("/admin/status", self._status)
        # Rollout workers on other machines (serve --ray) send their episode lines here.
        app.router.add_post(
            "/admin/episodes", episode_log_route(self.run_dir / "episodes.jsonl", require_admin)
        )
        from agentrl.view import mount as mount_view

        mount_view(app, self.view)  # read-only pages under /view
        assert self._listener is not None and self._starting is not None, \
            "the start-up status page opens the router's port first"
        if self.cfg.router.processes > 1:  # serve is router process 0 of several on its port
            from agentrl.serve.routers import RouterProcesses

            self.routers = RouterProcesses(self.cfg, admin_token=self.admin_token, engine_key=self.engine_key,
                                           model_path=str(self.model_path), run_dir=self.run_dir,
                                           api_keys=self.api_keys, listener=self._listener)
            self.routers.install(app, self.router)
            app[METRICS_OTHERS] = self.routers.others  # each child's exposition, labelled process="i"
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        if self.routers is not None:
            self._phase(f"starting {self.cfg.router.processes - 1} more router process(es)")
            await self.routers.start(self._runner, self.cfg.engine.start_timeout_s)
        # The real routes accept on the same listening socket before the start-up page lets go of it,
        # and the page answers what it accepted: a client in the handover is answered, never refused.
        await hand_over(self._listener, self._starting, self._runner)
        self._starting = None
        log.info("serving on %s (OpenAI base URL %s/v1; admin token in %s)", self.url, self.url,
                 self.run_dir / "admin_token")
        log.info("run view at %s/view/ (open it with ?token= and the token in %s or %s)", self.url,
                 self.run_dir / "view_token", self.run_dir / "admin_token")

    async def _info(self, request: web.Request) -> web.Response:
        from agentrl.web import require_admin

        require_admin(request)
        b = self.cfg.buffer
        return web.json_response({"model": self.cfg.model, "model_path": self.model_path,
                                  "version": self.pool.version, "env": self.cfg.env.name,
                                  "engine_dtype": self.cfg.engine.dtype,  # what a delta transport encodes in
                                  "batch_size": b.batch_size, "max_staleness": b.max_staleness,
                                  "group_size": self.cfg.env.group_size,
                                  "policies": {name: {"version": self.updater.policy_version(name),
                                                      "max_staleness": bound}
                                               for name, bound in self.cfg.staleness().items()}})

    def status(self) -> dict[str, Any]:
        """What /admin/status answers and serve_metrics.jsonl logs every 5 s (/metrics:
        :func:`prometheus_series`)."""
        rollout = self.cluster or self.orchestrator
        engines = self.pool.status()
        if self.local is not None:  # supervision: state (up / restarting / failed), restarts, pid
            for entry, local in zip(engines, self.local.status(), strict=True):
                entry.update(local)
        return {
            "uptime_s": time.time() - self.started, "version": self.pool.version,
            **({"policies": {name: self.updater.policy_version(name) for name in self.cfg.policies}}
               if self.cfg.policies else {}),
            "engines": engines, "router": dict(self.router.counters),
            **({"router_processes": self.routers.status()} if self.routers is not None else {}),
            "rollout": rollout.status() if rollout is not None else {},
            "buffer": self.buffer.stats(),
            "sandbox": self.sandbox_pool.stats() if self.sandbox_pool else None,
            **({"teacher": self.teacher_engine.status()} if self.teacher_engine is not None else {}),
        }

    async def _status(self, request: web.Request) -> web.Response:
        from agentrl.web import require_admin

        require_admin(request)
        return web.json_response(self.status())

    async def _metrics_loop(self) -> None:
        path = self.run_dir / "serve_metrics.jsonl"
        while True:
            await asyncio.sleep(5.0)
            try:
                line = json.dumps({"time": time.time(), **self.status()}, default=str)
            except Exception:
                log.warning("could not collect serve metrics", exc_info=True)
                continue
            # a full disk skips the line (whole or none) and tells the buffer's disk guard
            append_line(path, line, getattr(self.buffer, "disk", None))

    async def rollout_finished(self) -> None:
        """Until the rollout has played its ``max_episodes`` (forever without a limit, or with no rollout)."""
        if self._rollout_task is None:  # endpoint only: serve until stopped
            await asyncio.Event().wait()
        await self._rollout_task

    async def wait(self) -> None:
        """Until the rollout finishes (max_episodes), then forever: serve keeps serving. Raises
        :class:`~agentrl.serve.local.EngineFailed` when every engine serve launched has failed for
        good (died, and its relaunches too): with nothing left to serve, serve exits."""
        async def serving() -> None:
            await self.rollout_finished()
            while True:
                await asyncio.sleep(3600)

        if self.local is None:
            await serving()
            return
        tasks = [asyncio.create_task(serving()), asyncio.create_task(self.local.wait_all_failed())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[0] in done:
                tasks[0].result()  # the rollout failed: its own error
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        from agentrl.serve.local import EngineFailed

        raise EngineFailed("every engine serve launched has died and failed to come back "
                           f"(engine.max_restarts = {self.cfg.engine.max_restarts}); see the engine logs in "
                           f"{self.run_dir / 'logs'}")

    async def close(self) -> None:
        if self.local is not None and self.local.supervisor is not None:  # no relaunch while shutting down
            await self.local.supervisor.stop()
        if self._starting is not None:
            await self._starting.cleanup()
        if self.buffer is not None:  # a put waiting for disk space would hold the rollout's stop
            self.buffer.stop_disk_waits()
        for t in (self._rollout_task, self._metrics_task):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        if self.orchestrator is not None and self.orchestrator.concurrency is not None:
            await self.orchestrator.concurrency.stop()
        # then each part that was started, in this order, by its own closing method (sync or async)
        parts = (
            (self._runner, "cleanup"),
            (self.routers, "close"),
            (self._listener, "close"),
            (self.sandbox_pool, "close"),
            (self.router, "close"),
            (self.pool, "close"),
            (self.buffer, "close"),
            (self.local, "stop"),
            (self.teacher_engine, "close"),
            (self.cluster, "close"),
        )
        for part, method in parts:
            t0 = time.monotonic()
            if part is not None and inspect.isawaitable(done := getattr(part, method)()):
                await done
            if (took := time.monotonic() - t0) > 1.0:  # a slow shutdown names what it waited for
                log.info("shutdown: %s.%s took %.1f s", type(part).__name__, method, took)


async def serve_forever(cfg: ServeConfig) -> None:
    """serve until SIGINT/SIGTERM (also during start-up), then shut down in order."""
    serve = Serve(cfg)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopper = asyncio.create_task(stop.wait())
    try:
        starting = asyncio.create_task(serve.start())
        await asyncio.wait([starting, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.info("stopped during start-up (%s); stopping what was started", serve.phase)
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return
        starting.result()  # a start-up failure is raised here
        waiter = asyncio.create_task(serve.wait())
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        from agentrl.serve.local import EngineFailed

        failed = waiter.done() and not waiter.cancelled() and isinstance(waiter.exception(), EngineFailed)
        waiter.cancel()
        log.info("shutting down")
        if failed:
            raise waiter.exception()  # after the shutdown below: serve exits with the error
    finally:
        stopper.cancel()
        await serve.close()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_series(status: dict[str, Any]) -> dict[str, float]:
    """serve's own /metrics series beside the router's, from its status: the rollout's counters,
    the buffer's, the scoring stage's (each scorer's calls, failures, seconds and reward sum,
    labelled ``scorer``), each Ray rollout worker's own router's counters (``agentrl_router_*_total``
    labelled ``worker``), a self-distillation teacher's version, and
    with named LoRA policies each one's version and buffer depth, labelled ``policy``."""
    out: dict[str, float] = {}
    for name, version in (status.get("policies") or {}).items():
        lab = f'{{policy="{_label(name)}"}}'
        out[f"policy_version{lab}"] = version
        per = ((status.get("buffer") or {}).get("policies") or {}).get(name) or {}
        for k in ("depth", "pending", "consumed", "dropped"):
            if isinstance(per.get(k), int):
                out[f"buffer_policy_{k}{lab}"] = per[k]
    rollout = status.get("rollout") or {}
    for k in ("episodes", "failed", "truncated", "samples", "tool_calls"):
        if isinstance(rollout.get(k), int | float):
            out[f"rollout_{k}_total"] = rollout[k]
    if isinstance(rollout.get("in_flight"), int | float):
        out["rollout_in_flight"] = rollout["in_flight"]
    # each Ray rollout worker's own router's counters, beside serve's router's (the other router
    # processes' come in their own expositions, labelled process: router.server.METRICS_OTHERS)
    for entry in rollout.get("workers") or ():
        counters = entry.get("router") if isinstance(entry, dict) else None
        if isinstance(counters, dict):
            lab = f'{{worker="{_label(str(entry.get("worker")))}"}}'
            out.update({f"router_{k}_total{lab}": v for k, v in counters.items()
                        if isinstance(v, int | float)})
    concurrency = rollout.get("concurrency")
    if concurrency:  # the controller's limit, its inputs per engine and its decisions
        out["concurrency_limit"] = concurrency["limit"]
        out["concurrency_fallback"] = int(concurrency["fallback"])
        out["concurrency_paused"] = int(concurrency["paused"])
        out["concurrency_garbage_total"] = concurrency["garbage"]
        for decision, n in concurrency["decisions"].items():
            out[f'concurrency_decisions_total{{decision="{decision}"}}'] = n
        for name, reading in concurrency["engines"].items():
            lab = f'{{engine="{_label(name)}"}}'
            for k in ("running", "waiting", "kv", "preemptions"):
                if k in reading:
                    out[f"concurrency_engine_{k}{lab}"] = reading[k]
    for k, v in (status.get("buffer") or {}).items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[f"buffer_{k}"] = v
    scoring = rollout.get("scoring")
    if scoring:
        for k in ("scored", "failed", "timeouts"):
            out[f"scoring_{k}_total"] = scoring[k]
        for k in ("waiting", "scoring", "outage"):
            out[f"scoring_{k}"] = scoring[k]
        for name, s in scoring["scorers"].items():
            lab = f'{{scorer="{_label(name)}"}}'
            out[f"scoring_calls_total{lab}"] = s["calls"]
            out[f"scoring_failures_total{lab}"] = s["failures"]
            out[f"scoring_seconds_total{lab}"] = round(s["seconds"], 6)
            out[f"scoring_reward_sum{lab}"] = s["reward_sum"]
    teacher = status.get("teacher") or {}
    if isinstance(teacher.get("version"), int):
        out["teacher_version"] = teacher["version"]
    return out
