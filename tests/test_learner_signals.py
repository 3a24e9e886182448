"""A run with no learning signal says so: the learner warns once, with the figures and the usual cause.

The learner (``Learner.run`` on the tiny model, real train steps) is fed batches by a stand-in for
serve's buffer: an environment whose reward is constant gets the warning after ``no_signal_steps``
steps, a run whose groups' rewards differ does not.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agentrl.errors import ConfigError
from agentrl.learner.config import LearnConfig
from agentrl.learner.signals import SignalWatch
from agentrl.learner.trainer import learn
from tests.test_learner_packing import make_samples


class Batches:
    publishes = False

    def __init__(self, model: str, reward: Any) -> None:
        self.model, self.reward, self.i = model, reward, 0

    async def info(self) -> dict[str, Any]:
        return {"model_path": self.model, "version": 0}

    async def get_batch(self, version: int) -> tuple[str, list[Any]]:
        self.i += 1
        samples = make_samples(8, seed=self.i, groups=2)
        return f"b{self.i}", [replace(s, reward=self.reward(j)) for j, s in enumerate(samples)]

    async def publish(self, state: dict[str, Any], version: int) -> dict[str, Any]:
        return {}

    async def ack(self, batch_id: str) -> bool:
        return True

    async def release(self) -> int:
        return 0

    async def close(self) -> None:
        pass


def _learn(model: str, run_dir: Path, reward: Any, steps: int = 4) -> list[dict[str, Any]]:
    cfg = LearnConfig(model=model, run_dir=str(run_dir), steps=steps, micro_batch_tokens=256, metrics_port=-1)
    learn(cfg, Batches(model, reward))
    return [json.loads(line) for line in (run_dir / "learner.jsonl").read_text().splitlines()]


def test_a_constant_reward_gets_one_warning_that_names_the_cause(tiny_model: str, tmp_path: Path) -> None:
    rows = _learn(tiny_model, tmp_path, lambda j: 1.0)
    warned = [(r["step"], w) for r in rows for w in r.get("warnings", [])]
    assert [step for step, _ in warned] == [3]  # after 3 flat steps, once
    assert "flat_rewards" in warned[0][1] and "advantages are 0" in warned[0][1]


def test_a_run_whose_groups_differ_is_not_warned_about(tiny_model: str, tmp_path: Path) -> None:
    rows = _learn(tiny_model, tmp_path, lambda j: float(j % 4 == 0))  # each group has a winner
    assert all(r["advantage_std"] > 0 for r in rows)
    assert not any(r.get("warnings") for r in rows)


def test_the_watch_sees_tools_never_called_and_every_episode_truncated() -> None:
    samples = [replace(s, info={"tools": 2, "tool_calls": 0}, truncated=True) for s in make_samples(4)]
    watch = SignalWatch(steps=2)
    assert watch.observe(samples, advantage_std=0.5) == []
    second = watch.observe(samples, advantage_std=0.5)
    assert sorted(m.split()[3] for m in second) == ["(all_truncated):", "(no_tool_calls):"]
    assert watch.observe(samples, advantage_std=0.5) == []  # once per run
    called = [replace(s, info={"tools": 2, "tool_calls": 1}) for s in make_samples(4)]
    fresh = SignalWatch(steps=1)
    assert fresh.observe(called, advantage_std=0.5) == []


class SlowBatches(Batches):
    async def get_batch(self, version: int) -> tuple[str, list[Any]]:
        await asyncio.sleep(0.2)
        return await super().get_batch(version)


def test_max_minutes_ends_a_run_that_has_no_step_limit(tiny_model: str, tmp_path: Path) -> None:
    """``learn.max_minutes`` with ``steps = 0``: the learner stops after the step that ends its time
    and pulls no batch after it (the one an equal-time comparison needs)."""
    source = SlowBatches(tiny_model, lambda j: float(j % 4 == 0))
    cfg = LearnConfig(model=tiny_model, run_dir=str(tmp_path), steps=0, max_minutes=0.01,
                      micro_batch_tokens=256, metrics_port=-1)
    started = time.time()
    learn(cfg, source)
    rows = [json.loads(line) for line in (tmp_path / "learner.jsonl").read_text().splitlines()]
    assert rows and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert source.i == len(rows)  # no pull after the last step
    assert rows[-1]["time"] - started >= 0.6  # not before its 0.6 s


def test_max_minutes_must_not_be_negative(tiny_model: str) -> None:
    with pytest.raises(ConfigError, match="max_minutes"):
        LearnConfig(model=tiny_model, max_minutes=-1).check()
