"""The learner's metrics leave the process: Prometheus /metrics while it trains, TensorBoard events,
and a clear error when an optional writer's package is missing."""

from __future__ import annotations

import asyncio
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import LearnConfig
from agentrl.learner.config import WandbConfig
from agentrl.learner.metrics import MetricsServer, MissingExtra, flatten, make_writers
from tests.test_learner_resume import FixedBatches


class ScrapingBatches(FixedBatches):
    """Serves fixed batches; before the second one, scrapes the learner's /metrics as Prometheus would."""

    scraped: str = ""

    async def get_batch(self, version: int) -> tuple[str, list[Any]] | None:
        if version == 1 and not self.scraped:
            url = (self.run_dir / "learner_metrics_url").read_text().strip()
            self.scraped = await asyncio.to_thread(
                lambda: urllib.request.urlopen(url, timeout=10).read().decode()
            )
        return await super().get_batch(version)


@pytest.mark.slow
def test_a_training_learner_serves_prometheus_metrics_and_writes_tensorboard_events(
    tiny_model, tmp_path: Path
) -> None:
    from agentrl.learner.trainer import learn

    source = ScrapingBatches(tiny_model, tmp_path)
    cfg = LearnConfig(model=tiny_model, run_dir=str(tmp_path), steps=2, lr=1e-3, micro_batch_tokens=64,
                      metrics_port=0, tensorboard=True)
    history = learn(cfg, source)
    assert len(history) == 2
    text = source.scraped
    for name in (
        "agentrl_learner_step 1",
        "agentrl_learner_version 1",
        "agentrl_learner_loss ",
        "agentrl_learner_reward_mean ",
        "agentrl_learner_staleness_mean ",
        "agentrl_learner_tokens_per_s ",
        "agentrl_learner_idle_fraction ",
        "agentrl_learner_steps_total 1",
    ):
        assert name in text, text
    assert "# TYPE agentrl_learner_loss gauge" in text

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"loss", "reward_mean", "tokens_per_s", "idle_fraction"} <= set(tags)
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]
    assert acc.Scalars("loss")[0].value == pytest.approx(history[0]["loss"], rel=1e-5)


def test_metrics_server_answers_only_metrics_and_flattens_nested_sections() -> None:
    server = MetricsServer("127.0.0.1", 0)
    try:
        server.update(
            {"step": 3, "loss": 0.25, "engine_sync": {"total_s": 1.5}, "batch_id": "b3", "ok": True}
        )
        text = urllib.request.urlopen(server.url, timeout=10).read().decode()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url.replace("/metrics", "/other"), timeout=10)
        assert e.value.code == 404
    finally:
        server.close()
    assert "agentrl_learner_step 3" in text and "agentrl_learner_loss 0.25" in text
    assert "agentrl_learner_engine_sync_total_s 1.5" in text and "batch_id" not in text
    assert flatten({"a": {"b": 1, "c": "x"}, "d": False}) == {"a/b": 1.0}


def test_an_enabled_writer_whose_package_is_missing_says_what_to_install(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = LearnConfig(wandb=WandbConfig(project="p", mode="offline"))
    with pytest.raises(MissingExtra, match=r"agentrl\[wandb\]"):
        make_writers(cfg, tmp_path)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(MissingExtra, match=r"agentrl\[tensorboard\]"):
        make_writers(LearnConfig(tensorboard=True), tmp_path)
    assert make_writers(LearnConfig(), tmp_path) == []  # nothing asked, nothing imported
