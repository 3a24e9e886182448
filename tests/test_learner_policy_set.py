"""A single policy is a policy set of one: ``Learner.run`` on the tiny model, without serve.

The same batches, trained once as the unnamed policy of a single-policy run and once as the one
named policy of a multi-policy run (its own LoRA adapter, published by name), give the same
learner rows (but for the policy's name and step and the timings), the same losses and the same
published weights, step for step; each run's checkpoint resumes the run it belongs to; and the
checkpoints the learner wrote before the policy set (``tests/fixtures/checkpoints_before_policy_set``)
resume to the step that learner took from them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.buffer import Sample
from agentrl.config import LearnConfig
from agentrl.learner.lora import LoraConfig
from agentrl.learner.trainer import learn
from agentrl.weights.adapters import ADAPTER
from agentrl.weights.config import AdapterTransportConfig, WeightsConfig
from tests.conftest import RecordingSource
from tests.test_learner_packing import make_samples

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
NAME = "solver"
# what differs between two runs of the same steps: wall-clock time
TIMINGS = {"time", "wait_s", "train_s", "sync_s", "checkpoint_s", "step_s", "idle_fraction", "wait_fraction",
           "tokens_per_s"}


def _batch(tag: str, seed: int) -> list[Sample]:
    """Two groups of two episodes, each group with a winner (a learning signal)."""
    return [replace(s, sample_id=f"{tag}{i}", episode_id=f"{tag}-e{i}", group_id=f"{tag}-g{i % 2}",
                    reward=float(i < 2)) for i, s in enumerate(make_samples(4, seed=seed))]


BATCHES = [_batch("x", 1), _batch("y", 2), _batch("z", 3)]


class Serve(RecordingSource):
    """serve with one policy, unnamed (``name`` None) or named: the batches in turn; records what
    is published, with the adapter's keys as the unnamed policy's."""

    def __init__(self, model: str, name: str | None) -> None:
        super().__init__()
        self.model, self.name = model, name
        self.pulled = 0
        self.published: list[tuple[int, dict[str, torch.Tensor]]] = []

    async def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"model_path": self.model, "version": 0, "batch_size": 4, "max_staleness": 4}
        if self.name is not None:
            info["policies"] = {self.name: {"version": 0, "max_staleness": 4}}
        return info

    async def get_batch(self, version: int, **policy: str) -> tuple[str, list[Sample]] | None:
        assert policy == ({} if self.name is None else {"policy": self.name})
        i = self.pulled
        self.pulled += 1
        return f"b{i}", BATCHES[i % len(BATCHES)]

    async def publish(self, state: dict[str, Any], version: int, **policy: str) -> dict[str, Any]:
        assert policy == ({} if self.name is None else {"policy": self.name})
        named = f".{self.name}."
        self.published.append((version, {k.replace(named, f".{ADAPTER}.") if self.name else k: v.clone()
                                         for k, v in state.items()}))
        return {}


def _cfg(model: str, run_dir: Path, steps: int, **kw: Any) -> LearnConfig:
    return LearnConfig(model=model, run_dir=str(run_dir), steps=steps, lr=1e-2, micro_batch_tokens=256,
                       metrics_port=-1, seed=3, lora=LORA,
                       weights=WeightsConfig(transport=AdapterTransportConfig()), **kw)


def _without_timings(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in TIMINGS | {"policy", "policy_step"}}


def _run(model: str, run_dir: Path, name: str | None, steps: int,
         **kw: Any) -> tuple[list[dict[str, Any]], Serve]:
    serve = Serve(model, name)
    history = learn(_cfg(model, run_dir, steps, **kw), serve)
    return history, serve


def test_one_unnamed_policy_and_one_named_policy_train_and_publish_the_same(tiny_model: str,
                                                                           tmp_path: Path) -> None:
    one, one_serve = _run(tiny_model, tmp_path / "one", None, steps=3, checkpoint_every=1)
    named, named_serve = _run(tiny_model, tmp_path / "named", NAME, steps=3, checkpoint_every=1)

    assert [r["step"] for r in one] == [r["step"] for r in named] == [1, 2, 3]
    assert all("policy" not in r for r in one)
    assert [(r["policy"], r["policy_step"]) for r in named] == [(NAME, 1), (NAME, 2), (NAME, 3)]
    assert [r["loss"] for r in one] == [r["loss"] for r in named]
    assert [_without_timings(r) for r in one] == [_without_timings(r) for r in named]
    # the rows on disk are the rows returned
    on_disk = [json.loads(line) for line in (tmp_path / "one" / "learner.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in on_disk] == [r["loss"] for r in one]

    assert [v for v, _ in one_serve.published] == [v for v, _ in named_serve.published] == [1, 2, 3]
    for (_, a), (_, b) in zip(one_serve.published, named_serve.published, strict=True):
        assert a.keys() == b.keys() and a
        for k in a:
            assert torch.equal(a[k], b[k]), k

    # each checkpoint is its own run's: one policy's at "version", the named one's under "policies"
    meta_one = json.loads((tmp_path / "one" / "checkpoints" / "step_000003" / "meta.json").read_text())
    meta_named = json.loads((tmp_path / "named" / "checkpoints" / "step_000003" / "meta.json").read_text())
    assert meta_one["version"] == 3 and "policies" not in meta_one
    assert meta_named["policies"][NAME]["version"] == 3 and "version" not in meta_named


def test_a_resumed_unnamed_and_a_resumed_named_policy_go_on_alike(tiny_model: str, tmp_path: Path) -> None:
    for name, run in ((None, "one"), (NAME, "named")):
        _run(tiny_model, tmp_path / run, name, steps=2, checkpoint_every=1)
    one, one_serve = _run(tiny_model, tmp_path / "one", None, steps=3, resume=True)
    named, named_serve = _run(tiny_model, tmp_path / "named", NAME, steps=3, resume=True)

    assert [r["step"] for r in one] == [r["step"] for r in named] == [3]
    assert [r["version"] for r in one] == [r["version"] for r in named] == [3]
    assert [r["loss"] for r in one] == [r["loss"] for r in named]
    # serve was at version 0: the checkpoint's weights went out again before the first pull
    assert [v for v, _ in one_serve.published] == [v for v, _ in named_serve.published] == [2, 3]
    for (_, a), (_, b) in zip(one_serve.published, named_serve.published, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


# Checkpoints written by the learner before the policy set (commit cdd3b62), two steps of the runs
# above on batches x and y (LoRA, seed 3); a run of that learner resumed from them trained batch x
# next with this loss and gradient norm.
BEFORE = Path(__file__).parent / "fixtures" / "checkpoints_before_policy_set"
RESUMED_LOSS, RESUMED_GRAD_NORM = 0.045357893039653825, 0.0070543717592954636


def test_checkpoints_written_before_the_policy_set_resume_as_they_did(tiny_model: str,
                                                                     tmp_path: Path) -> None:
    import shutil

    for name, run in ((None, "one"), (NAME, "named")):
        shutil.copytree(BEFORE / run, tmp_path / run / "checkpoints")
        history, serve = _run(tiny_model, tmp_path / run, name, steps=3, resume=True)
        assert [(r["step"], r["version"]) for r in history] == [(3, 3)]
        assert history[0]["loss"] == pytest.approx(RESUMED_LOSS, rel=1e-6)
        assert history[0]["grad_norm"] == pytest.approx(RESUMED_GRAD_NORM, rel=1e-5)
        assert [v for v, _ in serve.published] == [2, 3]
        assert serve.events[0] == ("ack", "b1")  # the checkpointed batch, acknowledged again
