"""``ServeConfig``: the config tree of ``agentrl serve``, whose sections are the components' own configs.

engine -> :class:`~agentrl.engines.config.EngineConfig`, router ->
:class:`~agentrl.router.config.RouterConfig`, env -> :class:`~agentrl.rollout.config.RolloutConfig`
(an :class:`~agentrl.rollout.config.EpisodeLimits`), scaffold -> a tagged union
(:data:`~agentrl.rollout.config.ScaffoldConfig`), sandbox -> :class:`~agentrl.sandbox.types.SandboxConfig`,
buffer -> :class:`~agentrl.buffer.config.BufferConfig`, scoring ->
:class:`~agentrl.scoring.config.ScoringConfig`, ray -> :class:`RayConfig`. The builder
(:mod:`agentrl.serve.build`) hands each section to its component as it is; the few fields a
section cannot know (the buffer's group size and path, the sandbox image) are filled in there and
refused as settings. Only light modules are imported here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from agentrl.buffer.config import BufferConfig
from agentrl.engines.config import BASE_POLICY, EngineConfig
from agentrl.errors import ConfigError
from agentrl.rollout.config import LoopScaffold, RolloutConfig, ScaffoldConfig
from agentrl.router.config import RouterConfig
from agentrl.sandbox.types import SandboxConfig
from agentrl.scoring.config import ScoringConfig


@dataclass
class RayConfig:
    """Engines and rollout workers as Ray actors across a cluster (the buffer stays in serve; each
    worker routes its own model calls, ``local_router``)."""

    address: str = ""
    """Ray cluster to use ("auto": the one this machine belongs to, or "HOST:6379"); empty: no Ray"""
    namespace: str = "agentrl"  # Ray namespace of serve's actors
    engine_gpus: float = 0.0
    """GPUs per engine actor: 1 per engine, or a tensor-parallel group's size (0 on CPU)"""
    engine_cpus: float = 1.0  # CPUs reserved per engine actor
    engine_resources: dict[str, float] = field(default_factory=dict)
    """custom Ray resources per engine (placement)"""
    engine_host: str = ""  # address engines listen on; empty: their node's IP
    workers: int = 2  # rollout worker actors, each running an orchestrator of agent loops
    worker_cpus: float = 1.0  # CPUs reserved per rollout worker actor
    worker_resources: dict[str, float] = field(default_factory=dict)
    """custom Ray resources per worker (placement)"""
    worker_concurrency: int = 0  # episodes in flight per worker (0: env.max_concurrency / workers)
    local_router: bool = True
    """each rollout worker runs its own router (same capture, sessions and exact tokens; serve's
    engine pool and policy versions followed), so its model calls never cross serve; false: the
    workers call serve's router over HTTP (a worker node without the model's folder)"""
    serve_url: str = ""
    """how workers reach serve; empty: http://router.host:router.port (0.0.0.0: this node's IP)"""
    max_restarts: int = -1  # Ray restarts a dead actor this many times (-1: always); serve re-adds it


@dataclass
class PolicyConfig:
    """``serve.policies.<name>``: one of several LoRA policies on the engines' base model (multi-LoRA).
    A call picks it with ``"model": "<name>"``; it has its own adapter versions, buffer stream and
    staleness bound, and the learner trains its own adapter with its own optimizer."""

    max_staleness: int = -1  # the most versions its samples may lag its learner (-1: buffer.max_staleness)


POLICY_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


@dataclass
class ServeConfig:
    model: str = "tiny-tools"  # "tiny", "tiny-tools", "tiny-agent", "smollm2", a local folder or a hub name
    run_dir: str = "runs/latest"  # metrics, event log, session records, buffer, weights
    admin_token: str = ""
    """control routes; config file only (never --admin_token=); empty: see admin_token_file"""
    admin_token_file: str = ""
    """file holding the token; empty: $AGENTRL_ADMIN_TOKEN(_FILE), run_dir/admin_token, generated"""
    max_episodes: int = 0  # stop generating after this many episodes (0: no limit)
    restore: bool = True
    """On a run directory an earlier serve used, reload the newest weights its engines had loaded
    (``weights/v<N>``) and carry on at that version before serving: a restarted serve comes back
    where the run was. ``agentrl run`` sets it from ``learn.resume`` (a fresh run starts from the
    model's own weights)."""
    endpoint_only: bool = False
    """Start the engines, the router, the buffer and the weight routes, but no agent loops, sandboxes
    or Ray rollout workers (``agentrl serve --endpoint-only``): nothing plays the environment here.
    Episodes come from outside, from rollout workers or programs of one's own that open a session
    (``POST /admin/sessions``), make their model calls at ``/sessions/<id>/v1`` (recorded token for
    token), close it and put the scored samples into the buffer (``POST /buffer/samples``), as
    :mod:`agentrl.rollout.remote` does; the learner trains on those."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    env: RolloutConfig = field(default_factory=RolloutConfig)
    scaffold: ScaffoldConfig = field(default_factory=LoopScaffold)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    policies: dict[str, PolicyConfig] = field(default_factory=dict)
    """Named LoRA policies served at once on one base model (multi-LoRA; needs engine.lora_rank > 0, which
    ``agentrl run`` sets from learn.lora.rank): a call names its policy in ``model``, and the base model's
    own name (or ``default``) picks the first. Empty: one policy, chosen by any call."""

    def staleness(self) -> dict[str, int]:
        """Each named policy's staleness bound, in config order (empty: one unnamed policy)."""
        return {name: p.max_staleness if p.max_staleness >= 0 else self.buffer.max_staleness
                for name, p in self.policies.items()}

    def adapter_windows(self) -> dict[str, int]:
        """How many of each policy's newest versions the engines keep loaded as adapters: its staleness
        bound + 1 (every version a sample may still come from), or more where a role plays against it
        some versions back (``env.roles.<role>.lag``). Keyed by name; "" for the one unnamed policy."""
        bounds = self.staleness() or {"": self.buffer.max_staleness}
        first = next(iter(bounds))
        for b in self.env.roles.values():
            if b.lag:
                name = b.policy or first
                bounds[name] = max(bounds.get(name, 0), b.lag)
        return {name: bound + 1 for name, bound in bounds.items()}

    def pinned_versions(self) -> dict[str, set[int]]:
        """The versions roles play at (``env.roles.<role>.version``), which the engines keep loaded
        beside each policy's window once published. Keyed like :meth:`adapter_windows`."""
        first = next(iter(self.staleness()), "")
        pins: dict[str, set[int]] = {}
        for b in self.env.roles.values():
            if b.version:
                pins.setdefault(b.policy or first, set()).add(b.version)
        return pins

    def adapters_loaded(self) -> int:
        """LoRA adapter versions the engines hold at once: every policy's window and pinned versions,
        summed."""
        return sum(self.adapter_windows().values()) + sum(len(vs) for vs in self.pinned_versions().values())

    def without_secrets(self) -> ServeConfig:
        """This config with its admin token and client keys left out (for processes that get them
        otherwise)."""
        return dataclasses.replace(self, admin_token="", router=dataclasses.replace(self.router, api_keys=[]))

    def check(self) -> None:
        if self.env.group_size < 1:
            raise ConfigError("env.group_size must be at least 1")
        if self.buffer.batch_size % self.env.group_size:
            raise ConfigError(f"buffer.batch_size ({self.buffer.batch_size}) must be a multiple of "
                              f"env.group_size ({self.env.group_size}) so batches hold whole groups")
        if self.env.max_tokens >= self.engine.max_model_len:
            raise ConfigError("env.max_tokens must be smaller than engine.max_model_len")
        if self.engine.lora_rank < 0:
            raise ConfigError("engine.lora_rank must be 0 (LoRA off) or more")
        if not 1 <= self.router.processes <= 64:
            raise ConfigError(f"router.processes must be 1 to 64, not {self.router.processes}")
        if self.engine.lora_rank and self.scoring.teacher.lag:
            raise ConfigError("scoring.teacher.lag (self-distillation) with LoRA policies (engine.lora_rank "
                              "> 0) is not supported yet: the teacher engine loads full weights; train "
                              "without LoRA, or use a separate teacher (scoring.teacher.url)")
        self.check_policies()
        self.check_roles()
        loaded = self.adapters_loaded()
        if self.engine.lora_rank and self.engine.max_loras < loaded:
            raise ConfigError(f"engine.max_loras ({self.engine.max_loras}) must be at least "
                              f"{loaded} (each policy's max_staleness + 1, summed, and the versions "
                              "roles are pinned to): every version a sample may still come from stays "
                              "loaded as an adapter")
        self.check_sampling()
        self.scoring.check()
        if self.env.curriculum.enabled:
            try:
                self.env.curriculum.check()
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.env.concurrency.controller:
            try:
                self.env.concurrency.check()
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.scoring.judge.engine and self.ray.address:
            raise ConfigError("scoring.judge.engine (the judge on serve's own engine) is not supported with "
                              "serve --ray (ray.address): give the judge an endpoint, scoring.judge.url")
        if getattr(self.scaffold, "agent", None) == "" or getattr(self.scaffold, "command", None) == "":
            raise ConfigError(f"scaffold.kind = {self.scaffold.kind!r} "
                              f"needs its scaffold.{self.scaffold.kind}")


    def check_policies(self) -> None:
        for name, p in self.policies.items():
            if not POLICY_NAME.fullmatch(name) or name in (self.model, "default", BASE_POLICY):
                raise ConfigError(f"policies.{name[:60]}: a policy's name is a lowercase "
                                  "letter then up to 39 lowercase letters, digits or "
                                  "'_', other than the model's name, 'default' and 'base'")
            if p.max_staleness < -1:
                raise ConfigError(f"policies.{name}.max_staleness must be -1 (buffer.max_staleness) or more")
        if self.policies and not self.engine.lora_rank:
            raise ConfigError("serve.policies (several LoRA policies on one base model) needs "
                              "engine.lora_rank > 0 (agentrl run sets it from learn.lora.rank)")
        if self.policies and self.ray.address:
            raise ConfigError("serve.policies is not supported with serve --ray (ray.address) yet")

    def check_roles(self) -> None:
        """``env.roles``: each binding names one thing that can play its role here. (That the
        environment declares the roles is checked when the producer is built.)"""
        for role, b in self.env.roles.items():
            if not POLICY_NAME.fullmatch(role):
                raise ConfigError(f"env.roles.{role[:60]}: a role's name is a lowercase letter then up to 39 "
                                  "lowercase letters, digits or '_'")
            if sum((bool(b.policy or b.lag or b.version), bool(b.frozen), bool(b.endpoint))) > 1:
                raise ConfigError(f"env.roles.{role}: bind it to one of policy (with or without lag or "
                                  "version), frozen and endpoint")
            if b.advantage not in ("group", "baseline", "team") or not 0 <= b.loss_weight <= 100:
                raise ConfigError(f"env.roles.{role}: advantage is group, baseline or team, and loss_weight "
                                  "a number from 0 to 100")
            if b.lag < 0 or b.lag > 1000:
                raise ConfigError(f"env.roles.{role}.lag must be between 0 and 1000 versions")
            if b.lag and not self.engine.lora_rank:
                raise ConfigError(f"env.roles.{role}.lag: an earlier version is an adapter the engines "
                                  "keep loaded beside the newest, so it needs engine.lora_rank > 0 (LoRA "
                                  "training)")
            if b.version and b.lag:
                raise ConfigError(f"env.roles.{role}: lag (versions back, advancing) or version (one "
                                  "fixed published version), not both")
            if b.version < 0 or (b.version and not self.engine.lora_rank):
                raise ConfigError(f"env.roles.{role}.version: a published version (1 or more) is an "
                                  "adapter the engines keep loaded beside the newest, so it needs "
                                  "engine.lora_rank > 0 (LoRA training)")
            if b.policy and b.policy not in self.policies:
                raise ConfigError(f"env.roles.{role}.policy: {b.policy!r} is not a policy of serve.policies "
                                  f"({sorted(self.policies) or 'none named'})")
            if b.frozen and not self.engine.lora_rank:
                raise ConfigError(f"env.roles.{role}.frozen: the frozen base model is served beside LoRA "
                                  "adapters, so it needs engine.lora_rank > 0 (LoRA training); otherwise "
                                  "bind the role to an endpoint (env.roles.<role>.endpoint)")
            if b.endpoint and not b.endpoint.startswith(("http://", "https://")):
                raise ConfigError(f"env.roles.{role}.endpoint must be an http(s) base URL, "
                                  f"not {b.endpoint!r}")
        if self.env.roles and self.ray.address:
            raise ConfigError("env.roles (a multi-agent episode's bindings) works on one serve; not yet "
                              "with serve --ray")

    def check_sampling(self) -> None:
        """The built-in loop's sampling is one the learner can replay, and the engines can report."""
        e, r = self.env, self.router
        if not 0 < e.top_p <= 1 or not 0 <= e.min_p <= 1 or not 0 <= e.temperature <= 2 or e.top_k < 0:
            raise ConfigError("env.temperature must be in [0, 2], env.top_p in (0, "
                              "1], env.min_p in [0, 1] and env.top_k at least 0")
        if r.max_kept_tokens < 0:
            raise ConfigError("router.max_kept_tokens must be at least 0")
        if e.top_k > r.max_kept_tokens or ((e.top_p < 1 or e.min_p > 0) and not e.top_k):
            raise ConfigError(
                f"the built-in loop truncates the vocabulary (env.top_k={e.top_k}, env.top_p={e.top_p:g}, "
                f"env.min_p={e.min_p:g}): every token's kept set is recorded for the learner, so "
                f"set env.top_k between 1 and router.max_kept_tokens ({r.max_kept_tokens})")
        if not self.engine.urls and self.engine.max_logprobs <= r.max_kept_tokens:
            raise ConfigError(f"engine.max_logprobs ({self.engine.max_logprobs}) "
                              f"must exceed router.max_kept_tokens ({r.max_kept_tokens}): "
                              "kept sets are read from top_k + 1 top logprobs")


def redacted(cfg: ServeConfig) -> dict[str, Any]:
    """serve's config as a dict without its secrets (for files others may read)."""
    d = dataclasses.asdict(cfg)
    d["admin_token"] = "<redacted>" if d["admin_token"] else ""
    d["router"]["api_keys"] = ["<redacted>"] * len(d["router"]["api_keys"])
    return d
