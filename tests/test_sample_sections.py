"""A sample section declared outside the product: a toy per-token signal, written here only (its
field, its validation, its bytes, its micro-batch tensor, and a loss term that reads it), rides a
sample through the buffer's durable log, a restart, the HTTP batch route and a learner step; a
reader that does not know it skips it."""

from __future__ import annotations

import asyncio
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from agentrl.buffer import Buffer, BufferConfig, Sample
from agentrl.buffer.codec import CodecError, decode_sample, encode_sample, read_header
from agentrl.buffer.sections import Section, Values, register, sections
from agentrl.buffer.sections import base as registry
from agentrl.learner.terms import TermInputs, loss_term


@register
class ToyConfidence(Section):
    """The toy: a confidence level per token, 0 to 100 (255: none), one byte each after a u32 that
    counts the tokens that have one."""

    name = "test_toy_confidence"
    fields = ("toy_confidence",)

    def check(self, values: Values, tokens: int) -> Values:
        a = np.asarray(values["toy_confidence"])
        if a.shape != (tokens,) or a.dtype.kind not in "iu":
            raise ValueError(f"toy confidence must be integers over the {tokens} tokens, "
                             f"not {a.dtype} {a.shape}")
        if ((a > 100) & (a != 255)).any() or (a < 0).any():
            raise ValueError("toy confidence must be 0 to 100, or 255 for none")
        return {"toy_confidence": a.astype(np.uint8)}

    def encode(self, values: Values) -> bytes:
        a = values["toy_confidence"]
        return struct.pack("<I", int((a != 255).sum())) + a.tobytes()

    fill = float("nan")  # the tensor where a sample has no confidence

    def tensor(self, values: Values) -> np.ndarray:
        a = values["toy_confidence"]
        return np.where(a == 255, np.nan, a / 100).astype(np.float32)

    def decode(self, data: memoryview, tokens: int) -> Values:
        (scored,) = struct.unpack_from("<I", data, 0)
        if len(data) != 4 + tokens:
            raise ValueError(f"{len(data)} bytes for {tokens} tokens")
        a = np.frombuffer(data, dtype=np.uint8, offset=4).copy()
        if int((a != 255).sum()) != scored:
            raise ValueError(f"{scored} tokens scored in the head, {int((a != 255).sum())} in the body")
        return {"toy_confidence": a}


def sample(i: int, confidence: list[int] | None = None) -> Sample:
    return Sample(list(range(10, 17)), [0, 0, 0, 1, 1, 1, 1], [0.0] * 3 + [-0.5] * 4, [-1] * 3 + [0] * 4,
                  episode_id=f"e{i}", group_id=f"g{i}", env="toy", reward=float(i % 2), sample_id=f"s{i}",
                  toy_confidence=confidence)


CONFIDENCE = [255, 255, 255, 90, 40, 100, 0]


def test_a_section_declared_in_a_test_is_a_field_of_every_sample():
    s = sample(0, CONFIDENCE)
    assert "test_toy_confidence" in sections() and s.toy_confidence.dtype == np.uint8
    assert s.toy_confidence.tolist() == CONFIDENCE and sample(1).toy_confidence is None
    assert replace(s, toy_confidence=None) == replace(sample(0), sample_id=s.sample_id)
    assert s.to_dict()["toy_confidence"] == CONFIDENCE
    with pytest.raises(ValueError, match="toy confidence must be 0 to 100"):
        sample(0, [255, 255, 255, 90, 40, 101, 0])
    with pytest.raises(ValueError, match="over the 7 tokens"):
        sample(0, CONFIDENCE[:-1])


def test_the_toy_section_round_trips_through_a_record_beside_the_built_in_ones():
    rewards = np.full(7, np.nan, dtype=np.float32)
    rewards[-1] = 0.5
    s = replace(sample(0, CONFIDENCE), token_rewards=rewards)
    record, _ = encode_sample(s)
    assert read_header(record)["sections"] == ["token_rewards", "test_toy_confidence"]
    back = decode_sample(record)
    assert back == s and back.toy_confidence.tolist() == CONFIDENCE and back.toy_confidence.flags.writeable
    bad = bytearray(record)
    bad[-12:-8] = (5).to_bytes(4, "little")  # the toy's own head: 5 tokens scored, 4 in the body
    with pytest.raises(CodecError, match="section test_toy_confidence: 5 tokens scored"):
        decode_sample(bytes(bad))


def through_the_buffer(samples: list[Sample], directory: Path) -> list[Sample]:
    """``samples`` put into a durable buffer, read back by a restarted one over its HTTP batch route
    (what a learner gets), in sample-id order."""
    from aiohttp import web

    from agentrl.buffer import BufferClient, add_buffer_routes
    from agentrl.web import start_on_loopback

    cfg = BufferConfig(path=str(directory), batch_size=len(samples), max_staleness=2)

    async def write() -> None:
        buf = Buffer(cfg)
        assert await buf.put(samples) == len(samples)
        buf.close()

    async def read() -> list[Sample]:
        buf = Buffer(cfg)
        app = web.Application()
        add_buffer_routes(app, buf, "token")
        runner, url = await start_on_loopback(app)
        client = BufferClient(url, "token", timeout_s=5)
        try:
            batch = await client.get_batch(learner_version=0, max_staleness=2, batch_size=len(samples),
                                           timeout_s=1)
            assert batch is not None
            return sorted(batch.samples, key=lambda s: s.sample_id)
        finally:
            await client.close()
            await runner.cleanup()
            buf.close()

    asyncio.run(write())
    return asyncio.run(read())


def test_the_toy_section_survives_the_buffers_log_a_restart_and_the_http_batch_route(tmp_path: Path):
    put = [sample(i, CONFIDENCE if i % 2 else None) for i in range(4)]
    got = through_the_buffer(put, tmp_path / "buf")
    assert got == put
    assert [s.toy_confidence is None for s in got] == [True, False, True, False]


def test_a_reader_that_does_not_know_the_section_skips_it(monkeypatch: pytest.MonkeyPatch):
    record, _ = encode_sample(sample(3, CONFIDENCE))
    plain = sample(3)
    monkeypatch.delitem(registry._SECTIONS, ToyConfidence.name)
    monkeypatch.delitem(registry._FIELDS, "toy_confidence")
    back = decode_sample(record)
    assert back.sections == {} and back == plain


COEF = 0.5


@loss_term("toy_nll", section=ToyConfidence.name)
def toy_nll(x: TermInputs):
    """The toy's loss: each trained token's negative logprob, weighted by its confidence."""
    import torch

    where = x.mask & torch.isfinite(x.section)
    weight = torch.nan_to_num(x.section)
    return COEF * x.aggregate(-weight * x.logp, where), {"confidence": float(weight[where].mean())}


def test_the_toy_sections_tensor_is_padded_and_shifted_with_the_tokens():
    from agentrl.learner.packing import SECTION_KEY, pad_batch

    t = pad_batch([sample(0, CONFIDENCE[:3] + [20, 40, 60, 80]), sample(1)], pad_id=0)
    toy = t[SECTION_KEY + ToyConfidence.name]
    assert toy.shape == t["mask"].shape == (2, 6) and toy.dtype.is_floating_point
    assert toy[0, 2:].tolist() == pytest.approx([0.2, 0.4, 0.6, 0.8])  # position t: token t + 1
    assert toy[0, :2].isnan().all() and toy[1].isnan().all()
    assert SECTION_KEY + ToyConfidence.name not in pad_batch([sample(1)], pad_id=0)


def test_a_learner_step_adds_the_toy_loss_term_on_samples_that_carry_the_section(tiny_model: str,
                                                                                  tmp_path: Path):
    torch = pytest.importorskip("torch")
    from agentrl.config import LearnConfig
    from agentrl.learner.config import PGLoss
    from agentrl.learner.dist import Dist, load_model
    from agentrl.learner.packing import packed_logprobs, pad_batch
    from agentrl.learner.step import build_state, eval_mode, train_step
    from tests.test_learner_packing import make_samples

    # equal rewards: every advantage is 0, so the policy loss is 0 and only the toy's term trains
    plain = [replace(s, reward=1.0) for s in make_samples(4, seed=3)]
    rng = np.random.default_rng(0)
    toy = [replace(s, toy_confidence=np.where(s.loss_mask != 0, rng.integers(0, 101, len(s.token_ids)), 255))
           for s in plain]
    toy = through_the_buffer(toy, tmp_path / "buf")  # the learner's samples come over the batch route
    cfg = LearnConfig(lr=1e-2, micro_batch_tokens=10_000, loss=PGLoss(correction="none"))
    results = {}
    for name, samples in (("plain", plain), ("toy", toy)):
        torch.manual_seed(0)
        state = build_state(cfg, load_model(tiny_model, Dist()), Dist())
        before = torch.cat([p.detach().flatten().clone() for p in state.model.parameters()])
        with torch.no_grad(), eval_mode(state.model):
            logp = packed_logprobs(state.model, samples)
        stats = train_step(state, samples, cfg, 1)
        after = torch.cat([p.detach().flatten() for p in state.model.parameters()])
        results[name] = stats, logp, bool((after != before).any())
    (plain_stats, _, plain_moved), (toy_stats, logp, toy_moved) = results["plain"], results["toy"]
    assert "toy_nll/confidence" not in plain_stats and not plain_moved
    assert toy_moved and 0.0 < toy_stats["toy_nll/confidence"] < 1.0
    t = pad_batch(toy, 0)
    confidence, mask = t["section:" + ToyConfidence.name], t["mask"] != 0
    expected = COEF * float((-(confidence.nan_to_num() * logp))[mask].sum()) / float(mask.sum())
    assert toy_stats["loss"] == pytest.approx(expected, rel=1e-4)


def test_a_section_table_that_does_not_match_the_bodies_is_a_codec_error():
    record, _ = encode_sample(sample(0, CONFIDENCE))
    ((name, offset, length),) = read_header(record)["table"]
    at = record.index(struct.pack("<III", len(name), offset, length))
    bad = bytearray(record)
    bad[at + 4 : at + 8] = struct.pack("<I", offset + 4)  # the body said to start 4 bytes later
    with pytest.raises(CodecError, match="at offset"):
        decode_sample(bytes(bad))
    bad = bytearray(record)
    bad[at + 8 : at + 12] = struct.pack("<I", length + 8)  # a body longer than the record holds
    with pytest.raises(CodecError, match="expected"):
        decode_sample(bytes(bad))
