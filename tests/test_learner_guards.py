"""The learner cannot train a batch wrong: ``Learner.run`` on the tiny model, real train steps.

- A serve that restarts between the learner's pull and its ack (serve's real buffer over real
  HTTP: ``Buffer`` + ``add_buffer_routes`` on aiohttp, its durable log surviving the restart)
  answers the ack 409; the batch's samples come back in a new batch and are not trained again.
- On resume the learner publishes its checkpoint's weights before it pulls, when serve is not
  at their version.
- A step whose loss is not finite publishes nothing and does not advance the version.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.buffer import Buffer, BufferClient, BufferConfig, Sample, add_buffer_routes
from agentrl.config import LearnConfig
from agentrl.learner.trainer import Learner, learn
from tests.conftest import RecordingSource
from tests.test_learner_packing import make_samples

TOKEN = "s3cret"


def _group(tag: str, n: int = 4, seed: int = 0) -> list[Sample]:
    """Two groups of two episodes, each group with a winner; ids that say which set they belong to."""
    return [replace(s, sample_id=f"{tag}{i}", episode_id=f"{tag}-e{i}", group_id=f"{tag}-g{i % 2}",
                    reward=float(i < 2)) for i, s in enumerate(make_samples(n, seed=seed))]


class Serve:
    """serve's buffer on loopback, durable in ``path``; ``restart`` stops it and starts a new one
    on the same port from the same log (what a restarted serve does)."""

    def __init__(self, path: Path) -> None:
        self.path, self.port = path, 0
        self.buf: Buffer | None = None
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        self.buf = Buffer(BufferConfig(path=str(self.path), batch_size=4, group_size=2, max_staleness=4))
        app = web.Application()
        add_buffer_routes(app, self.buf, TOKEN)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def restart(self) -> None:
        assert self.runner is not None and self.buf is not None
        await self.runner.cleanup()
        self.buf.close()
        await self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class RestartingSource:
    """The learner's source over HTTP; serve restarts while the first version is being published,
    that is after the learner pulled its first batch and before it acks it. A restarted serve
    reports version 0 (its engines came back with base weights)."""

    publishes = True
    weights_device = "cpu"

    def __init__(self, serve: Serve, model: str) -> None:
        self.serve, self.model = serve, model
        self.client = BufferClient(serve.url, TOKEN, timeout_s=10)
        self.version = 0
        self.restarted = False
        self.events: list[tuple[Any, ...]] = []

    async def info(self) -> dict[str, Any]:
        return {"model_path": self.model, "version": self.version}

    async def get_batch(self, version: int) -> tuple[str, list[Any]] | None:
        batch = await self.client.get_batch(version, max_staleness=4, batch_size=4, timeout_s=2)
        if batch is None:
            return None
        self.events.append(("batch", batch.batch_id, sorted(s.sample_id for s in batch.samples)))
        return batch.batch_id, batch.samples

    async def publish(self, state: dict[str, Any], version: int) -> dict[str, Any]:
        self.events.append(("publish", version))
        self.version = version
        if not self.restarted:
            self.restarted = True
            await self.serve.restart()
            self.version = 0
            assert self.serve.buf is not None
            await self.serve.buf.put(_group("b", seed=2))  # new episodes for the learner's second step
        return {}

    async def ack(self, batch_id: str) -> bool:
        acked = await self.client.ack(batch_id)
        self.events.append(("ack", batch_id, acked))
        return acked

    async def release(self) -> int:
        return await self.client.release_leases()

    async def close(self) -> None:
        await self.client.close()


def test_a_batch_whose_ack_a_restarted_serve_refuses_is_not_trained_again(
    tiny_model: str, tmp_path: Path
) -> None:
    async def go() -> tuple[list[dict[str, Any]], RestartingSource, dict[str, Any], Learner]:
        serve = Serve(tmp_path / "buffer")
        await serve.start()
        assert serve.buf is not None
        await serve.buf.put(_group("a", seed=1))
        source = RestartingSource(serve, tiny_model)
        learner = Learner(LearnConfig(model=tiny_model, run_dir=str(tmp_path / "run"), steps=2, lr=1e-3,
                                      micro_batch_tokens=256, metrics_port=-1), source)
        try:
            history = await learner.run()
            return history, source, serve.buf.stats(), learner
        finally:
            assert serve.runner is not None
            await serve.runner.cleanup()
            serve.buf.close()

    history, source, stats, learner = asyncio.run(go())
    a, b = [f"a{i}" for i in range(4)], [f"b{i}" for i in range(4)]
    batch_a, again, batch_b = (e for e in source.events if e[0] == "batch")
    # the restarted buffer served a's samples again
    assert batch_a[2] == a and again[2] == a and batch_b[2] == b
    assert again[1] != batch_a[1]  # in a new batch
    assert source.events == [
        batch_a, ("publish", 1), ("ack", batch_a[1], False),  # serve restarted in between: 409
        ("publish", 1),  # serve came back at version 0: the learner's weights again, before pulling on
        again, ("ack", again[1], True),  # acknowledged without a step: those samples are in the weights
        batch_b, ("publish", 2), ("ack", batch_b[1], True),
    ]
    assert [(r["step"], r["version"], r["batch_id"], r["acked"]) for r in history] == [
        (1, 1, batch_a[1], False), (2, 2, batch_b[1], True)]
    assert history[1]["guards"] == {"acks_rejected": 1, "republished": 1, "samples_trained_before": 4,
                                    "batches_trained_before": 1}
    assert stats["consumed"] == 8 and stats["pending"] == 0 and stats["identity_holds"]
    assert not learner.trained  # every remembered id was confirmed consumed, then forgotten


class Recorded(RecordingSource):
    """Fixed batches from a list; records what the learner asks for; serve's version is settable."""

    def __init__(self, model: str, batches: list[list[Sample]], version: int = 0) -> None:
        self.model, self.batches, self.version = model, batches, version
        super().__init__()
        self.i = 0

    async def info(self) -> dict[str, Any]:
        return {"model_path": self.model, "version": self.version}

    async def get_batch(self, version: int) -> tuple[str, list[Any]] | None:
        self.i += 1
        self.events.append(("batch", f"b{self.i}", version))
        return f"b{self.i}", self.batches[(self.i - 1) % len(self.batches)]

    async def publish(self, state: dict[str, Any], version: int) -> dict[str, Any]:
        assert state  # the full weights
        self.events.append(("publish", version))
        self.version = version
        return {}


def _cfg(model: str, run_dir: Path, steps: int, **kw: Any) -> LearnConfig:
    kw.setdefault("checkpoint_every", 1)
    return LearnConfig(model=model, run_dir=str(run_dir), steps=steps, lr=1e-3, micro_batch_tokens=256,
                       metrics_port=-1, **kw)


def test_on_resume_the_learner_publishes_its_checkpoint_before_the_first_pull(
    tiny_model: str, tmp_path: Path
) -> None:
    batches = [_group("a", seed=3), _group("b", seed=4), _group("c", seed=5)]
    first = Recorded(tiny_model, batches)
    learn(_cfg(tiny_model, tmp_path, steps=2), first)
    # nothing at start: 0 == 0
    assert [e for e in first.events if e[0] == "publish"] == [("publish", 1), ("publish", 2)]

    restarted = Recorded(tiny_model, batches, version=0)  # serve came back with its base weights at 0
    learn(_cfg(tiny_model, tmp_path, steps=3, resume=True), restarted)
    # the checkpointed batch acked again (idempotent), then the checkpoint's weights, then the first pull
    assert restarted.events[:4] == [("ack", "b2"), ("publish", 2), ("batch", "b1", 2), ("publish", 3)]

    ahead = Recorded(tiny_model, batches, version=5)  # serve holds versions a dead learner published later
    learn(_cfg(tiny_model, tmp_path, steps=4, resume=True), ahead)
    # no number reused
    assert ahead.events[:4] == [("ack", "b1"), ("publish", 6), ("batch", "b1", 6), ("publish", 7)]

    current = Recorded(tiny_model, batches, version=7)  # serve already serves the checkpoint's weights
    learn(_cfg(tiny_model, tmp_path, steps=5, resume=True), current)
    assert current.events[:3] == [("ack", "b1"), ("batch", "b1", 7), ("publish", 8)]


def test_a_non_finite_step_publishes_nothing_and_keeps_the_version(
    tiny_model: str, tmp_path: Path, caplog
) -> None:
    poisoned = _group("p", seed=6)
    lps = list(poisoned[2].logprobs)
    lps[-1] = float("nan")
    poisoned[2] = replace(poisoned[2], logprobs=lps)
    source = Recorded(tiny_model, [poisoned, _group("q", seed=7)])
    with caplog.at_level(logging.WARNING):
        history = learn(_cfg(tiny_model, tmp_path, steps=1), source)
    assert source.events == [("batch", "b1", 0), ("ack", "b1"),  # not trained, not published, acknowledged
                             ("batch", "b2", 0), ("publish", 1), ("ack", "b2")]
    assert [(r["step"], r["version"], r["batch_id"]) for r in history] == [(1, 1, "b2")]
    assert history[0]["guards"]["not_applied_non_finite_loss"] == 1
    assert any("p2" in r.getMessage() and "non_finite_loss" in r.getMessage() for r in caplog.records)


def test_a_batch_mixing_trained_and_new_samples_trains_only_the_new(tiny_model: str, tmp_path: Path) -> None:
    old, new = _group("o", seed=8), _group("n", seed=9)
    source = Recorded(tiny_model, [old, old[:2] + new[:2]])
    learner = Learner(_cfg(tiny_model, tmp_path, steps=2, checkpoint_every=0), source)
    original_ack = source.ack

    async def refuse_first(batch_id: str) -> bool:  # the first ack is lost (serve restarted)
        await original_ack(batch_id)
        return batch_id != "b1"

    source.ack = refuse_first  # type: ignore[method-assign]
    history = asyncio.run(learner.run())
    assert [r["trained_samples"] for r in history] == [4, 2]  # o0, o1 came back and were left out
    assert history[1]["guards"]["samples_trained_before"] == 2
    assert set(learner.trained) == {"o2", "o3"}  # still unconfirmed: they may come back too


def test_a_checkpointed_batch_the_buffer_forgot_is_not_trained_again_after_resume(tiny_model: str,
                                                                                  tmp_path: Path) -> None:
    a, b = _group("a", seed=11), _group("b", seed=12)
    learn(_cfg(tiny_model, tmp_path, steps=1), Recorded(tiny_model, [a]))  # the checkpoint names batch b1
    source = Recorded(tiny_model, [a, b], version=1)  # serve restarted: a's samples are pending again
    acks: list[str] = []

    async def ack(batch_id: str) -> bool:
        acks.append(batch_id)
        return len(acks) > 1  # the re-ack of the checkpointed batch: unknown to the restarted buffer

    source.ack = ack  # type: ignore[method-assign]
    history = learn(_cfg(tiny_model, tmp_path, steps=2, resume=True), source)
    assert acks == ["b1", "b1", "b2"]  # re-ack refused; a's samples came back as b1, acked without a step
    assert [(r["step"], r["version"], r["batch_id"]) for r in history] == [(2, 2, "b2")]
    assert history[0]["guards"]["batches_trained_before"] == 1


def test_the_learner_rides_out_a_serve_that_does_not_answer(
    tiny_model: str, tmp_path: Path, monkeypatch
) -> None:
    from agentrl.errors import TransportError
    from agentrl.learner import trainer

    monkeypatch.setattr(trainer, "RETRY_S", 0.01)
    source = Recorded(tiny_model, [_group("r", seed=13)])
    # calls that find serve down before it answers again (a learner started during a serve restart
    # first releases its predecessor's leases)
    down = {"release": 2, "get_batch": 1, "ack": 2}
    calls = {"release": source.release, "get_batch": source.get_batch, "ack": source.ack}

    def flaky(name: str) -> Any:
        async def call(*args: Any) -> Any:
            if down[name]:
                down[name] -= 1
                raise TransportError("connection refused")  # no answer: retryable
            return await calls[name](*args)
        return call

    source.release = flaky("release")  # type: ignore[method-assign]
    source.get_batch = flaky("get_batch")  # type: ignore[method-assign]
    source.ack = flaky("ack")  # type: ignore[method-assign]
    history = learn(_cfg(tiny_model, tmp_path, steps=1, checkpoint_every=0), source)
    assert [(r["version"], r["acked"]) for r in history] == [(1, True)]
    assert source.events == [("batch", "b1", 0), ("publish", 1), ("ack", "b1")]
    assert down == {"release": 0, "get_batch": 0, "ack": 0}
