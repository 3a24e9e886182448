"""``agentrl serve --ray ADDRESS``: engines and rollout workers as Ray actors across a cluster.

The serve process is the Ray driver and keeps the buffer, the engine pool's membership, the router
external programs call and the HTTP routes. On the
cluster it places:

- one :class:`EngineHost` actor per engine (``ray.engine_gpus`` GPUs each: one GPU or one
  tensor-parallel group; ``ray.engine_cpus`` on CPU). The actor launches and supervises a vLLM
  process on its node (:class:`agentrl.engines.vllm.VLLMEngine`, which dies with the actor) and
  reports the engine's URL; the router's pool sends traffic there.
- ``ray.workers`` :class:`RolloutWorkerHost` actors, each running an orchestrator of agent loops
  (built from serve's own config by :mod:`agentrl.serve.build`, as serve builds its own) against
  a router of its own (:class:`~agentrl.serve.routers.FollowingRouter`: sessions record exact
  tokens there, and the calls go straight to the engines, following serve's view of the pool), or with
  ``ray.local_router = false`` against serve's router over HTTP; finished episodes go into
  serve's buffer (``/buffer/samples``), with admission control (``/buffer/room``). An environment
  that needs sandboxes gets a sandbox pool on the worker's node.

Supervision: actors are created with ``max_restarts`` (Ray re-creates a dead actor's process; an
engine host exits when its vLLM process dies, so a crashed engine is restarted too). The driver
re-issues ``run`` to a restarted worker, re-points the pool when an engine comes back at another
URL (the pool's health check reloads the current weights before it takes traffic), and spawns a
fresh actor when Ray has given up on one. ``close`` kills every actor; their engines die with them.

With ``engine.urls`` (engines that already run, e.g. stand-in engines in ``benchmarks/cluster_sim.py``)
serve places only the rollout workers. Ray is imported only here, and only when
``serve.ray.address`` is set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.serve.config import ServeConfig

if TYPE_CHECKING:
    from types import ModuleType

    from agentrl.engines.pool import EnginePool
    from agentrl.rollout.orchestrator import Orchestrator

log = logging.getLogger(__name__)

COUNTERS = ("in_flight", "episodes", "failed", "truncated", "samples", "reward_sum", "tool_calls")


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise SystemExit(
            "serve.ray.address is set but Ray is not installed: pip install 'agentrl[ray]'"
        ) from None
    return ray


class EngineHost:
    """Actor body: one vLLM engine process on this node, launched at construction.

    A watchdog thread exits the actor's process when the engine dies on its own, so Ray's restart
    brings back both; the engine (through its reaper) dies with the actor's process.
    """

    def __init__(self, spec: dict[str, Any], log_dir: str, host: str = "") -> None:
        import ray

        from agentrl.engines.vllm import EngineSpec, VLLMEngine

        self.node_id = ray.get_runtime_context().get_node_id()
        spec = dict(spec, host=host or ray.util.get_node_ip_address())
        self.engine = VLLMEngine(EngineSpec(**spec), Path(log_dir))
        self.engine.launch()  # from the actor's main thread: the reaper's parent-death signal follows it
        self._stopping = False
        threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping:
            if not self.engine.alive() and not self._stopping:
                log.error("engine %s exited (code %s); restarting its actor", self.engine.url,
                          self.engine.proc.returncode if self.engine.proc else None)
                os._exit(1)
            time.sleep(1.0)

    def start(self, timeout_s: float) -> dict[str, Any]:
        asyncio.run(self.engine.start(timeout_s))
        return self.info()

    def info(self) -> dict[str, Any]:
        return {"url": self.engine.url, "pid": os.getpid(), "engine_pid": self.engine.pid,
                "alive": self.engine.alive(), "node_id": self.node_id}

    def stop(self) -> None:
        self._stopping = True
        self.engine.stop()


class RolloutWorkerHost:
    """Actor body: an orchestrator of agent loops, built from serve's own config, with its own router
    (:class:`~agentrl.serve.routers.FollowingRouter`) or serve's over HTTP, putting its episodes into
    serve's buffer."""

    def __init__(self, worker_id: str, serve_url: str, admin_token: str, cfg: ServeConfig,
                 max_concurrency: int, engine_key: str = "", model_path: str = "") -> None:
        import ray

        self.worker_id, self.serve_url, self.admin_token = worker_id, serve_url, admin_token
        self.engine_key, self.model_path = engine_key, model_path
        self.cfg = cfg
        self.max_concurrency = max_concurrency
        self.node_id = ray.get_runtime_context().get_node_id()
        self.orchestrator: Orchestrator | None = None
        self.router: Any = None
        self.started = time.time()

    async def run(self, max_episodes: int = 0) -> None:
        """Play episodes until cancelled, or until ``max_episodes`` have started (0: no limit)."""
        from agentrl.rollout.remote import EpisodeUploader, RemoteBuffer, RemoteRouter
        from agentrl.serve import build
        from agentrl.serve.routers import FollowingRouter

        cfg = self.cfg
        build.import_user_code(cfg)
        own = FollowingRouter(cfg, self.serve_url, self.admin_token, self.engine_key, self.model_path) \
            if cfg.ray.local_router else None
        remote = None if own else RemoteRouter(self.serve_url, self.admin_token,
                                                timeout_s=cfg.env.episode_timeout_s)
        buffer = RemoteBuffer(self.serve_url, self.admin_token, producer=f"{self.worker_id}-{os.getpid()}")
        episodes = EpisodeUploader(self.serve_url, self.admin_token)
        uploading = asyncio.create_task(episodes.run(), name="episode-uploads")
        sandbox_pool = None
        try:
            if own is not None:
                self.router = await own.start()
                scaffold = build.load_scaffold_of(cfg)
                router_url = await own.serve_http() if scaffold is not None else ""
            else:
                self.router = await remote.__aenter__()
                router_url = self.serve_url
            sandbox_pool = await build.build_sandbox_pool(cfg, self.worker_id)
            producer = build.build_producer(cfg, self.router, sandbox_pool, router_url=router_url)
            # the concurrency controller (env.concurrency) reads the engines of the worker's own router
            self.orchestrator = build.build_orchestrator(
                cfg, producer, buffer, max_episodes=max_episodes, max_concurrency=self.max_concurrency,
                episode_log=lambda line: episodes.add({"worker": self.worker_id, **line}),
                engines=own.router.pool if own is not None else None)
            if self.orchestrator.concurrency is not None:
                self.orchestrator.concurrency.start()
            log.info(
                "rollout worker %s (pid %d) playing %s against %s",
                self.worker_id,
                os.getpid(),
                cfg.env.name,
                self.serve_url,
            )
            await self.orchestrator.run()
        finally:
            if self.orchestrator is not None and self.orchestrator.concurrency is not None:
                await self.orchestrator.concurrency.stop()
            uploading.cancel()
            await asyncio.gather(uploading, return_exceptions=True)
            await episodes.close()
            if sandbox_pool is not None:
                await sandbox_pool.close()
            await buffer.close()
            if own is not None:
                await own.close()
            else:
                await remote.__aexit__(None, None, None)

    async def status(self) -> dict[str, Any]:
        counts = self.orchestrator.status() if self.orchestrator is not None else {}
        started = self.orchestrator.started if self.orchestrator is not None else 0
        out = {"worker": self.worker_id, "pid": os.getpid(), "node_id": self.node_id,
               "uptime_s": time.time() - self.started, "started": started, **counts}
        if isinstance(getattr(self.router, "counters", None), dict):  # its own router's
            out["router"] = dict(self.router.counters)
        return out

    async def ping(self) -> int:
        return os.getpid()


class RayCluster:
    """The driver side: places actors, supervises them, reports them in serve's status."""

    def __init__(self, cfg: ServeConfig, model_path: str, run_dir: Path, engine_key: str = "") -> None:
        self.cfg = cfg
        self.engine_key = engine_key  # to the engine actors through Ray's channels, never a command line
        self.model_path = model_path
        self.run_dir = run_dir
        self.ray = import_ray()
        self.engines: list[Any] = []  # actor handles, index i serves pool engine i
        self.engine_info: list[dict[str, Any]] = []
        self.workers: list[Any] = []
        self.worker_info: list[dict[str, Any]] = []
        self.restarts = {"engines": 0, "workers": 0, "respawned": 0}
        self._finished_counts: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)  # from worker lives that ended
        # episodes each worker may still start (serve.max_episodes split over them); None: no limit
        self.budgets: list[int | None] = []
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    # -- engines ----------------------------------------------------------------------------------
    def _connect(self) -> None:
        ray, rc = self.ray, self.cfg.ray
        if not ray.is_initialized():
            ray.init(address=rc.address, namespace=rc.namespace, log_to_driver=False)
        log.info("connected to Ray at %s: %s", rc.address, ray.cluster_resources())

    def _engine_actor(self, i: int) -> Any:
        cfg, rc = self.cfg, self.cfg.ray
        spec = dataclasses.replace(cfg.engine.spec(i, self.model_path, cfg.model), api_key=self.engine_key)
        spec_dict = {k: v for k, v in vars(spec).items() if k != "host"}
        actor_cls = self.ray.remote(EngineHost).options(
            num_cpus=rc.engine_cpus, num_gpus=rc.engine_gpus, resources=dict(rc.engine_resources) or None,
            max_restarts=rc.max_restarts, max_task_retries=0, max_concurrency=1)
        return actor_cls.remote(spec_dict, str((self.run_dir / "logs").resolve()), rc.engine_host)

    async def connect(self) -> None:
        """Join the Ray cluster (``ray.address``; rollout workers only when engine.urls names the engines)."""
        await asyncio.to_thread(self._connect)

    async def start_engines(self) -> list[str]:
        """Place ``engine.count`` engine actors and wait until every engine is healthy; their URLs."""
        await self.connect()
        n = self.cfg.engine.count
        self.engines = [self._engine_actor(i) for i in range(n)]
        log.info("starting %d engine actor(s) on the Ray cluster", n)
        self.engine_info = list(await asyncio.gather(
            *(a.start.remote(self.cfg.engine.start_timeout_s) for a in self.engines)))
        for info in self.engine_info:
            log.info("engine actor ready at %s (node %s)", info["url"], info["node_id"][:12])
        return [info["url"] for info in self.engine_info]

    async def _watch_engine(self, i: int, pool: EnginePool) -> None:
        ray = self.ray
        while not self._closing:
            await asyncio.sleep(2.0)
            try:
                info = await asyncio.wait_for(
                    asyncio.wrap_future(self.engines[i].info.remote().future()), 600
                )
            except (ray.exceptions.RayActorError, TimeoutError) as e:
                if self._closing:
                    return
                if isinstance(e, ray.exceptions.ActorDiedError) and not await self._alive(self.engines[i]):
                    log.warning("engine actor %d is gone for good (%s); spawning a new one", i, e)
                    self.engines[i] = self._engine_actor(i)
                    self.restarts["respawned"] += 1
                continue
            old = self.engine_info[i]
            if info["pid"] != old.get("pid"):
                self.restarts["engines"] += 1
                log.warning("engine actor %d restarted (pid %s -> %s) at %s", i, old.get("pid"), info["pid"],
                            info["url"])
            if info["url"] != old.get("url") and i < len(pool.engines):
                # back on another node: point the pool there; its health check reloads the weights
                pool.engines[i].url = info["url"].rstrip("/")
                pool.engines[i].healthy = False
            self.engine_info[i] = info

    # -- rollout workers --------------------------------------------------------------------------
    def _worker_actor(self, i: int, serve_url: str, token: str) -> Any:
        cfg, rc = self.cfg, self.cfg.ray
        e = cfg.env
        per_worker = rc.worker_concurrency or max(e.group_size, e.max_concurrency // max(1, rc.workers))
        actor_cls = self.ray.remote(RolloutWorkerHost).options(
            num_cpus=rc.worker_cpus, resources=dict(rc.worker_resources) or None,
            max_restarts=rc.max_restarts, max_task_retries=0)
        # the admin token travels in the actor's task spec (Ray's own channels), never on a command line;
        # the config itself travels without secrets
        # (and the engine key, for a worker's own router)
        return actor_cls.remote(f"worker-{i}", serve_url, token, cfg.without_secrets(), per_worker,
                                self.engine_key, self.model_path)

    async def _alive(self, actor: Any) -> bool:
        try:
            await asyncio.wait_for(asyncio.wrap_future(actor.ping.remote().future()), 300)
            return True
        except Exception:
            return False

    async def _keep_running(self, i: int, serve_url: str, token: str) -> None:
        ray = self.ray
        while not self._closing:
            budget = self.budgets[i] if i < len(self.budgets) else None
            if budget is not None and budget <= 0:
                log.info("rollout worker %d has started its share of serve.max_episodes", i)
                return
            try:
                await asyncio.wrap_future(self.workers[i].run.remote(max_episodes=budget or 0).future())
                log.info("rollout worker %d finished", i)
                return
            except ray.exceptions.RayActorError as e:
                if self._closing:
                    return
                last = self.worker_info[i] if i < len(self.worker_info) else {}
                if budget is not None:  # what the lost life started (as of its last report) is spent
                    self.budgets[i] = budget - int(last.get("started") or 0)
                for k in COUNTERS:
                    if k != "in_flight":
                        self._finished_counts[k] += float(last.get(k) or 0)
                self.worker_info[i] = {"worker": f"worker-{i}", "restarting": True}
                self.restarts["workers"] += 1
                log.warning("rollout worker %d died (%s); %s", i, type(e).__name__,
                            "Ray restarts it" if self.cfg.ray.max_restarts else "spawning a new one")
                if not await self._alive(self.workers[i]):
                    self.workers[i] = self._worker_actor(i, serve_url, token)
                    self.restarts["respawned"] += 1

    async def _poll_workers(self) -> None:
        while not self._closing:
            for i, actor in enumerate(list(self.workers)):
                try:
                    st = await asyncio.wait_for(asyncio.wrap_future(actor.status.remote().future()), 10)
                except Exception:
                    continue
                self.worker_info[i] = st  # a restarted worker's counts start again at zero
            await asyncio.sleep(2.0)

    async def run_workers(self, serve_url: str, token: str, pool: EnginePool) -> None:
        """Place the rollout workers and supervise workers and engines until cancelled."""
        n = self.cfg.ray.workers
        self.budgets = split_episodes(self.cfg.max_episodes, self.cfg.env.group_size, n)
        if self.cfg.max_episodes and 0 in self.budgets:
            n = self.budgets.index(0)  # fewer groups than workers: the rest would have nothing to play
            self.budgets = self.budgets[:n]
        self.workers = [self._worker_actor(i, serve_url, token) for i in range(n)]
        self.worker_info = [{"worker": f"worker-{i}"} for i in range(n)]
        log.info("started %d rollout worker actor(s) against %s", n, serve_url)
        self._tasks = [asyncio.create_task(self._keep_running(i, serve_url, token), name=f"worker-{i}")
                       for i in range(n)]
        self._tasks += [asyncio.create_task(self._watch_engine(i, pool), name=f"engine-watch-{i}")
                        for i in range(len(self.engines))]
        self._tasks.append(asyncio.create_task(self._poll_workers(), name="worker-status"))
        try:
            await asyncio.gather(*self._tasks[:n])  # the workers; the watchers run until close
            while True:
                await asyncio.sleep(3600)
        finally:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- status and shutdown ----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The rollout counters summed over workers (what the orchestrator reports in one process)."""
        out = dict(self._finished_counts)
        out["in_flight"] = 0.0
        for st in self.worker_info:
            for k in COUNTERS:
                if isinstance(st.get(k), int | float):
                    out[k] += float(st[k])
        out["workers"] = [dict(st) for st in self.worker_info]
        out["engine_actors"] = [dict(info) for info in self.engine_info]
        out["restarts"] = dict(self.restarts)
        return out

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        ray = self.ray
        for actor in self.workers:
            ray.kill(actor, no_restart=True)
        stops = [a.stop.remote() for a in self.engines]
        if stops:
            await asyncio.to_thread(ray.wait, stops, num_returns=len(stops), timeout=60)
        for actor in self.engines:
            ray.kill(actor, no_restart=True)
        await asyncio.to_thread(ray.shutdown)


def split_episodes(max_episodes: int, group_size: int, workers: int) -> list[int | None]:
    """Each rollout worker's share of ``max_episodes``, in whole groups (0: no limit, ``None`` each).

    The shares add up to ``max_episodes`` rounded up to a whole group, as one process would start
    them; earlier workers take one group more when they do not divide evenly, and a worker with no
    group gets 0.
    """
    if max_episodes <= 0:
        return [None] * workers
    groups = -(-max_episodes // group_size)
    return [(groups // workers + (1 if i < groups % workers else 0)) * group_size for i in range(workers)]


def default_serve_url(cfg: ServeConfig) -> str:
    """How rollout workers reach serve: ``ray.serve_url``, else router.host:port (0.0.0.0: this node's IP)."""
    if cfg.ray.serve_url:
        return cfg.ray.serve_url.rstrip("/")
    host = cfg.router.host
    if host in ("0.0.0.0", "::", ""):
        try:
            import ray

            host = ray.util.get_node_ip_address()
        except Exception:
            host = socket.gethostbyname(socket.gethostname())
    return f"http://{host}:{cfg.router.port}"
