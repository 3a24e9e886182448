"""Several environments in one run: each task drawn from one of them, played by its own rules.

``--env.name=mix --env.config='{"envs": {"arithmetic": {}, "guess_number": {"high": 20}}}'``
(optionally ``"weights": {"arithmetic": 3, "guess_number": 1}``). The tasks of the named
environments are interleaved in proportion to their weights (a smooth weighted round-robin, so any
stretch of the stream holds each in its share; held-out evaluation's first N tasks too). Each
task carries its environment's name under ``mix_env``; an episode builds that environment, hands
it the task without the tag, and delegates ``reset``, ``step``, ``reward`` and ``close`` to it.
Each step's ``info`` names the environment (``mix_env``), so ``episodes.jsonl`` tells them apart,
and the scoring stage picks a teacher per environment by it (``scoring.teachers``). With
``"policies": {"arithmetic": "solver", "guess_number": "proposer"}`` each environment's tasks are
played by that named LoRA policy (``serve.policies``; the task's ``policy``), which learns from them.

Invariants: a mix holds tool or step environments (a playing one, which runs its own episode, is
refused with a config error). serve keeps a sandbox pool for each image its environments name;
an episode gets a sandbox of its own environment's image, or none when that one needs none. An
environment whose split runs out leaves the rest to go on; the mix's split ends when all of
theirs have.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import agentrl
from agentrl.env import make
from agentrl.env.base import MIX_TAG, PlayingEnv
from agentrl.env.registry import lookup
from agentrl.errors import ConfigError

TAG = MIX_TAG


def interleave(
    streams: dict[str, Iterator[dict[str, Any]]], weights: dict[str, float]
) -> Iterator[tuple[str, dict]]:
    """(name, task) pairs drawn from ``streams`` by smooth weighted round-robin: each turn every
    stream gains its weight and the one furthest ahead gives a task and pays the total. A stream
    that runs out drops out; the rest go on in their proportions."""
    live = dict(streams)
    credit = dict.fromkeys(live, 0.0)
    while live:
        total = sum(weights[n] for n in live)
        for n in live:
            credit[n] += weights[n]
        name = max(live, key=lambda n: (credit[n], -list(live).index(n)))
        credit[name] -= total
        try:
            yield name, next(live[name])
        except StopIteration:
            del live[name], credit[name]


def _joined(images: Iterable[str | None]) -> str | None:
    """Distinct images, comma-separated (serve then keeps a pool per image); None: none."""
    return ",".join(sorted({i for i in images if i})) or None


_KINDS: dict[str, tuple[bool, str | None]] = {}


def _kind(name: str, config: dict[str, Any]) -> tuple[bool, str | None]:
    """(whether ``name`` plays its own episodes, the sandbox image it names), found once per name and
    config: a mix is built for every episode, and a factory's answer costs one more environment."""
    key = json.dumps([name, config], sort_keys=True, default=str)
    if key not in _KINDS:
        _KINDS[key] = _find_kind(name, config)
    return _KINDS[key]


def _find_kind(name: str, config: dict[str, Any]) -> tuple[bool, str | None]:
    obj = lookup(name)
    if not isinstance(obj, type):  # a factory: only an instance tells
        obj = make(name, **config)
    playing = issubclass(obj, PlayingEnv) if isinstance(obj, type) else isinstance(obj, PlayingEnv)
    return playing, getattr(obj, "sandbox_image", None) or None


@agentrl.environment("mix")
class MixEnv(agentrl.Environment):
    """Several environments in one run, interleaved by weight; each episode plays its task's own."""

    def __init__(self, envs: dict[str, dict[str, Any]] | None = None, weights: dict[str, float] | None = None,
                 policies: dict[str, str] | None = None) -> None:
        if not envs or not isinstance(envs, dict):
            raise ConfigError('env.config of "mix" names its environments: {"envs": {"arithmetic": {}, '
                              '"guess_number": {}}} (each with its own keyword arguments)')
        if "mix" in envs:
            raise ConfigError("a mix cannot hold another mix")
        self.envs = {name: dict(cfg or {}) for name, cfg in envs.items()}
        weights = dict(weights or {})
        unknown = sorted(set(weights) - set(self.envs))
        if unknown:
            raise ConfigError(f"mix weights name {unknown}, which are not in its envs {sorted(self.envs)}")
        self.weights = {n: float(weights.get(n, 1.0)) for n in self.envs}
        if any(w <= 0 for w in self.weights.values()):
            raise ConfigError(f"mix weights must be positive, got {self.weights}")
        # which named LoRA policy (serve.policies) plays each environment's tasks; none: the default
        self.policies = {str(n): str(p) for n, p in (policies or {}).items()}
        unknown = sorted(set(self.policies) - set(self.envs))
        if unknown:
            raise ConfigError(f"mix policies name {unknown}, which are not in its envs {sorted(self.envs)}")
        self.images: dict[str, str | None] = {}
        for name, cfg in self.envs.items():
            playing, self.images[name] = _kind(name, cfg)
            if playing:
                raise ConfigError(f"{name!r} plays its own episodes (a PlayingEnv); a mix "
                                  "holds tool and step environments only: run it on its own")
        self.sandbox_image = _joined(self.images.values())
        self.inner: agentrl.Environment | None = None
        self.name = ""

    @classmethod
    def sandbox_image_of(cls, config: dict[str, Any]) -> str | None:
        """The images serve's sandbox pool holds for a mix of ``config`` (its environments' own)."""
        return cls(**config).sandbox_image

    def sandbox_image_for(self, task: dict[str, Any]) -> str:
        """The image of the task's environment ("": it needs no sandbox, and gets none)."""
        return self.images.get(task.get(TAG, ""), None) or ""

    def tasks(self, split: str = "train") -> Iterable[dict[str, Any]]:
        streams = {name: iter(make(name, **cfg).tasks(split)) for name, cfg in self.envs.items()}
        for name, task in interleave(streams, self.weights):
            policy = self.policies.get(name)
            yield {**task, TAG: name, **({"policy": policy} if policy else {})}

    def _enter(self, task: dict[str, Any]) -> dict[str, Any]:
        """Build the task's environment (once per episode) and give the task back without the tag."""
        name = task.get(TAG)
        if name not in self.envs:
            raise ValueError(f"task {task.get('id')!r} names no environment of this mix ({TAG}={name!r}; "
                             f"the mix holds {sorted(self.envs)})")
        if self.inner is None:
            self.inner, self.name = make(name, **self.envs[name]), name
            self.inner.sandbox = self.sandbox  # attached for the task (sandbox_image_for), or None
        elif name != self.name:
            raise ValueError(f"this episode plays {self.name!r}, not {name!r}")
        return {k: v for k, v in task.items() if k != TAG}

    async def reset(self, task: dict[str, Any]) -> agentrl.Reset:
        inner_task = self._enter(task)
        assert self.inner is not None
        return await self.inner.reset(inner_task)

    async def step(self, message: dict[str, Any]) -> agentrl.StepResult:
        if self.inner is None:
            raise RuntimeError("step before reset")
        result = await self.inner.step(message)
        result.info[TAG] = self.name
        return result

    async def reward(self, task: dict[str, Any], answer: str) -> float:
        inner_task = self._enter(task)
        assert self.inner is not None
        return await self.inner.reward(inner_task, answer)

    async def close(self) -> None:
        if self.inner is not None:
            self.inner.sandbox = None  # the machinery releases it
            await self.inner.close()
