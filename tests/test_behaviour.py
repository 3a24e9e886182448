"""The behaviour record (per-call sampling settings, per-token kept sets): its invariants, its bytes
in the buffer, and the learner's replay of it, against hand-computed values."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from agentrl.buffer.behaviour import NEUTRAL, Behaviour
from agentrl.buffer.codec import CodecError, decode_sample, encode_sample, read_header
from agentrl.buffer.sample import Sample

torch = pytest.importorskip("torch")

TOKENS = np.array([1, 2, 3, 4, 3, 5, 6, 3, 2, 4], dtype=np.int32)
MASK = [0, 0, 0, 1, 1, 1, 0, 1, 1, 1]
PENALISED = {"temperature": 0.7, "top_k": 3, "repetition_penalty": 1.3, "frequency_penalty": 0.4,
             "presence_penalty": 0.2}
KEPT = [[4, 1, 2], [3, 0, 9], [5, 6, 7]]


def sample(behaviour: Behaviour | None, tokens: np.ndarray = TOKENS, mask: list[int] = MASK) -> Sample:
    return Sample(tokens, mask, [-0.5 * m for m in mask], [0 if m else -1 for m in mask], episode_id="e",
                  group_id="g", env="t", reward=1.0, behaviour=behaviour)


def two_calls() -> Behaviour:
    return Behaviour.from_calls(10, [(7, 3, {"temperature": 1.5}, None), (3, 3, PENALISED, KEPT)], TOKENS)


def test_a_behaviour_holds_each_calls_settings_and_each_tokens_kept_set():
    b = two_calls()
    assert b.starts.tolist() == [3, 7] and b.lengths.tolist() == [3, 3]
    assert b.settings(0) == pytest.approx({**NEUTRAL, **PENALISED})
    assert b.settings(1) == {**NEUTRAL, "temperature": 1.5}
    assert b.kept_counts.tolist() == [0, 0, 0, 3, 3, 3, 0, 0, 0, 0]
    off = b.kept_offsets()
    assert [b.kept_ids[off[i]:off[i + 1]].tolist() for i in (3, 4, 5)] == KEPT


def test_a_sampled_token_outside_its_kept_set_or_spans_that_overlap_are_refused():
    with pytest.raises(ValueError, match="not in its kept set"):
        Behaviour.from_calls(10, [(3, 3, PENALISED, [[1, 2], [3], [5]])], TOKENS)
    with pytest.raises(ValueError, match="disjoint"):
        Behaviour.from_calls(10, [(3, 3, {}, None), (4, 2, {}, None)], TOKENS)
    with pytest.raises(ValueError, match="outside every call span"):
        Behaviour(np.array([3]), np.array([1]), np.ones((1, 7)), np.array([0, 1, 0, 0]), np.array([2]))
    with pytest.raises(ValueError, match="covers"):
        sample(Behaviour.from_calls(4, [], TOKENS[:4]))


def test_a_sample_with_a_behaviour_round_trips_through_a_record_with_a_behaviour_section():
    s = sample(two_calls())
    record, meta = encode_sample(s)
    assert read_header(record)["v"] == meta["v"] == 6 and read_header(record)["sections"] == ["behaviour"]
    back = decode_sample(record)
    assert back == s and back.behaviour == s.behaviour
    # 36 bytes per call, 2 bytes per kept id below 2**16, a few runs: the cost of the record, beyond the
    # section table (a count, an entry, the name padded: 4 + 12 + 12 bytes) and the section's 16-byte head
    plain, _ = encode_sample(sample(None))
    assert len(record) - len(plain) == 4 + 12 + 12 + 16 + 2 * 36 + 8 * 3 + 2 * 9 + 2


def test_kept_ids_beyond_a_u16_travel_as_int32():
    tokens = TOKENS.copy()
    tokens[3] = 100_000
    b = Behaviour.from_calls(10, [(3, 1, {"top_k": 2}, [[100_000, 7]])], tokens)
    record, _ = encode_sample(sample(b, tokens))
    ((name, offset, _),) = read_header(record)["table"]
    assert name == "behaviour" and int.from_bytes(record[offset + 12 : offset + 16], "little") == 4  # width
    assert decode_sample(record).behaviour == b


def test_samples_without_a_behaviour_are_still_format_2_records_and_old_records_still_read():
    s = sample(None)
    record, _ = encode_sample(s)
    assert record[:4] == b"ARS2" and read_header(record)["v"] == 2
    assert decode_sample(record) == s and decode_sample(record).behaviour is None


def test_a_cut_or_inconsistent_behaviour_section_is_a_codec_error():
    record, _ = encode_sample(sample(two_calls()))
    with pytest.raises(CodecError):
        decode_sample(record[:-4])
    bad = bytearray(record)
    # kept-count runs cover 16 of 10
    bad[-8 - 2 * 9 - 2:-2 * 9 - 2] = np.array([5, 11], dtype="<i4").tobytes()
    with pytest.raises(CodecError, match="kept-count runs"):
        decode_sample(bytes(bad))


def test_to_dict_gives_the_behaviour_as_json():
    import json

    d = json.loads(json.dumps(sample(two_calls()).to_dict()))
    assert d["behaviour"]["calls"][1]["temperature"] == 1.5
    assert d["behaviour"]["kept"] == {"3": KEPT[0], "4": KEPT[1], "5": KEPT[2]}


# -- the learner's replay ---------------------------------------------------------------------------

def reference_logprob(logits: torch.Tensor, t: int, settings: dict, kept: list[int] | None) -> float:
    """vLLM's sampler by hand, for token ``t`` of a call that started at 3 (prompt TOKENS[:3])."""
    z = logits[t - 1].clone()
    prompt, out = TOKENS[:3].tolist(), TOKENS[3:t].tolist()
    s = {**NEUTRAL, **settings}
    for v in range(z.shape[0]):
        if v in prompt or v in out:
            r = s["repetition_penalty"]
            z[v] = z[v] * (1 / r) if z[v] > 0 else z[v] * r
        count = out.count(v)
        z[v] -= s["frequency_penalty"] * count + s["presence_penalty"] * (count > 0)
    z = z / s["temperature"]
    if kept is not None:
        outside = torch.ones_like(z, dtype=torch.bool)
        outside[kept] = False
        z = z.masked_fill(outside, -math.inf)
    return torch.log_softmax(z, -1)[int(TOKENS[t])].item()


def test_the_replay_applies_penalties_temperature_and_the_kept_set_as_the_engine_does():
    from agentrl.learner.replay import RowReplay, replayed_log_softmax, replayed_logprobs

    torch.manual_seed(0)
    logits = torch.randn(9, 11) * 3
    plan = RowReplay.build([sample(two_calls())])
    targets = torch.as_tensor(TOKENS[1:], dtype=torch.long)
    got = replayed_logprobs(logits, targets, plan)
    for t, kept in zip((3, 4, 5), KEPT, strict=True):
        assert got[t - 1].item() == pytest.approx(reference_logprob(logits, t, PENALISED, kept), abs=1e-5)
    for t in (7, 8, 9):  # the second call: temperature 1.5, nothing else
        assert got[t - 1].item() == pytest.approx(
            torch.log_softmax(logits[t - 1] / 1.5, -1)[TOKENS[t]].item(), abs=1e-6
        )
    plain = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    # prompt and tool tokens: plain log-softmax, bit for bit
    assert torch.equal(got[[0, 1, 5]], plain[[0, 1, 5]])
    # the whole distribution: nothing outside the kept sets, each kept set sums to 1
    full = replayed_log_softmax(logits, plan)
    assert torch.allclose(full.gather(-1, targets[:, None])[:, 0], got, atol=1e-6)
    for t, kept in zip((3, 4, 5), KEPT, strict=True):
        outside = torch.ones(11, dtype=torch.bool)
        outside[kept] = False
        assert torch.isinf(full[t - 1][outside]).all()
        assert full[t - 1][kept].exp().sum().item() == pytest.approx(1.0, abs=1e-6)


def test_greedy_calls_replay_at_temperature_one_and_neutral_ones_are_plain_log_softmax():
    from agentrl.learner.replay import RowReplay, replayed_logprobs

    logits = torch.randn(9, 11)
    targets = torch.as_tensor(TOKENS[1:], dtype=torch.long)
    plain = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    greedy = Behaviour.from_calls(10, [(3, 3, {"temperature": 0.0}, None)], TOKENS)
    assert RowReplay.build([sample(greedy)]).empty
    neutral = Behaviour.from_calls(10, [(3, 3, dict(NEUTRAL), None)], TOKENS)
    assert torch.equal(replayed_logprobs(logits, targets, RowReplay.build([sample(neutral)])), plain)


def random_sample(rng: random.Random, vocab: int, i: int) -> Sample:
    """A sample of two calls with random settings, kept sets around each sampled token."""
    prompt, first, gap, second = rng.randint(2, 6), rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 8)
    n = prompt + first + gap + second
    tokens = np.array([rng.randrange(vocab) for _ in range(n)], dtype=np.int32)
    calls = []
    for start, length in ((prompt, first), (prompt + first + gap, second)):
        settings = {
            "temperature": rng.choice([0.5, 0.7, 1.0, 1.3]),
            "repetition_penalty": rng.choice([1.0, 1.2]),
            "presence_penalty": rng.choice([0.0, 0.5]),
            "frequency_penalty": rng.choice([0.0, -0.3]),
        }
        kept = None
        if rng.random() < 0.6:
            settings["top_k"] = 4
            kept = [sorted({int(tokens[start + j]), *rng.sample(range(vocab), 3)}) for j in range(length)]
        calls.append((start, length, settings, kept))
    mask = np.zeros(n, dtype=np.int32)
    for start, length, _, _ in calls:
        mask[start:start + length] = 1
    b = Behaviour.from_calls(n, calls, tokens)
    return Sample(tokens, mask, np.zeros(n, np.float32), np.where(mask == 1, 0, -1), episode_id=f"e{i}",
                  group_id="g", env="t", reward=0.0, behaviour=b)


def test_a_packed_row_replays_each_sample_as_it_alone(tiny_model):
    from transformers import AutoModelForCausalLM

    from agentrl.learner.packing import packed_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = random.Random(3)
    samples = [random_sample(rng, vocab, i) for i in range(5)]
    with torch.no_grad():
        packed = packed_logprobs(model, samples)
        plain = packed_logprobs(model, samples, replay=False)
        for i, s in enumerate(samples):
            alone = packed_logprobs(model, [s])[0]
            n = len(s.token_ids) - 1
            assert (packed[i, :n] - alone[:n]).abs().max().item() < 1e-5
            generated = torch.as_tensor(s.loss_mask[1:] == 1)
            assert (packed[i, :n][~generated] - plain[i, :n][~generated]).abs().max().item() < 1e-6
            assert (packed[i, :n][generated] - plain[i, :n][generated]).abs().max().item() > 1e-3


def test_the_replayed_logprob_carries_a_gradient_to_the_kept_logits_only():
    from agentrl.learner.replay import RowReplay, replayed_logprobs

    logits = torch.randn(9, 11, requires_grad=True)
    b = Behaviour.from_calls(10, [(3, 1, {"temperature": 0.7, "top_k": 3}, [KEPT[0]])], TOKENS)
    lp = replayed_logprobs(
        logits, torch.as_tensor(TOKENS[1:], dtype=torch.long), RowReplay.build([sample(b)])
    )
    lp[2].backward()
    grad = logits.grad[2]
    outside = torch.ones(11, dtype=torch.bool)
    outside[KEPT[0]] = False
    assert (grad[outside] == 0).all() and (grad[KEPT[0]] != 0).all()
