"""Typed configuration: one tree per command, loaded from TOML/YAML plus ``--a.b=value`` overrides.

The trees are made of the components' own configs (see :mod:`agentrl.serve.config` and
:mod:`agentrl.learner.config`); the machinery (key and type checks, tagged unions, documentation
for ``agentrl config show``) is in :mod:`agentrl.config.loader`. ``RunConfig`` is ``agentrl run``:
serve's tree, learn's tree and the held-out evaluation, with the quickstart's recipe as its
defaults (:data:`RUN_DEFAULTS`). This package imports nothing heavy, so ``agentrl --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agentrl.config.loader import (
    build,
    field_docs,
    merge,
    parse,
    resolve,
    to_dict,
    to_toml,
    union_kinds,
)
from agentrl.config.loader import load as _load
from agentrl.errors import ConfigError
from agentrl.learner.config import LearnConfig, LossConfig
from agentrl.rollout.config import EpisodeLimits, EvalConfig
from agentrl.serve.config import ServeConfig, redacted

__all__ = [
    "RUN_DEFAULTS",
    "ConfigError",
    "EpisodeLimits",
    "EvalConfig",
    "LearnConfig",
    "LossConfig",
    "RunConfig",
    "ServeConfig",
    "build",
    "field_docs",
    "load",
    "merge",
    "parse",
    "redacted",
    "resolve",
    "to_dict",
    "to_toml",
    "union_kinds",
]

T = TypeVar("T")

# What `agentrl run` changes from serve's and learn's own defaults: the quickstart's model and RL
# recipe, measured to learn within 20 minutes on a 2-core CPU (docs/learner.md). `load` merges them
# under the config file and the overrides, key by key, so `--serve.model=X` keeps the rest. Groups
# of 4 (8 tasks a step) rather than 8 (4 tasks): over five seeds every run gained at least 0.2 and
# the batch reward of the last 20 steps varied less (std 0.131-0.157 against 0.159-0.180), the
# step-to-step swing being mostly which few tasks a batch drew (docs/curriculum.md).
RUN_DEFAULTS: dict[str, Any] = {
    "serve": {"model": "tiny-agent", "env": {"group_size": 4}, "buffer": {"batch_size": 32}},
    "learn": {"lr": 1e-4, "steps": 60},
}


@dataclass
class RunConfig:
    serve: ServeConfig = field(default_factory=ServeConfig)
    learn: LearnConfig = field(default_factory=LearnConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    restarts: int = 3
    """relaunches in a row of a serve child that died while the learner runs (-1: no limit, 0: none)"""

    def check(self) -> None:
        if self.restarts < -1:
            raise ConfigError("restarts must be -1 (no limit) or more")
        self.wire_lora()
        self.serve.check()
        self.learn.check()
        if self.eval.tasks < 0 or self.eval.concurrency < 1:
            raise ConfigError("eval.tasks must be >= 0 and eval.concurrency >= 1")
        b, lc = self.serve.buffer, self.learn
        # said once: the learner takes serve's batch size and staleness bound
        if lc.batch_size not in (0, b.batch_size):
            raise ConfigError(f"learn.batch_size ({lc.batch_size}) differs from "
                              f"serve.buffer.batch_size ({b.batch_size}); agentrl "
                              "run shares the buffer's: set serve.buffer.batch_size")
        if lc.max_staleness not in (-1, b.max_staleness):
            raise ConfigError(f"learn.max_staleness ({lc.max_staleness}) differs from "
                              f"serve.buffer.max_staleness ({b.max_staleness}); agentrl "
                              "run shares the buffer's: set serve.buffer.max_staleness")


    def wire_lora(self) -> None:
        """LoRA (learn.lora.rank > 0): serve's engines take adapters of that rank, and the learner
        sends the adapter alone (unless weights.transport names another kind than the default)."""
        lora, engine = self.learn.lora, self.serve.engine
        if not lora.enabled:
            return
        engine.lora_rank = max(engine.lora_rank, lora.rank)
        engine.max_loras = max(engine.max_loras, self.serve.adapters_loaded())
        if self.learn.weights.transport.kind == "http":
            from agentrl.weights.config import AdapterTransportConfig

            self.learn.weights.transport = AdapterTransportConfig()


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build ``cls`` from an optional TOML/YAML file and ``a.b=value`` overrides, then check it
    (``RunConfig`` starts from :data:`RUN_DEFAULTS`)."""
    return _load(cls, path, overrides, RUN_DEFAULTS if cls is RunConfig else None)
