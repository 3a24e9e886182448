"""Sequence packing: packed rows give the same logprobs, loss and gradient as padded samples."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")


def make_samples(n: int, seed: int = 0, vocab: int = 200, groups: int = 2):
    from agentrl.buffer.sample import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, completion = rng.randint(3, 20), rng.randint(1, 30)
        ids = [rng.randrange(3, vocab) for _ in range(prompt + completion)]
        mask = [0] * prompt + [1] * completion
        lps = [0.0] * prompt + [-rng.uniform(0.5, 5.0) for _ in range(completion)]
        versions = [-1] * prompt + [0] * completion
        out.append(Sample(ids, mask, lps, versions, episode_id=f"e{i}", group_id=f"g{i % groups}", env="t",
                          reward=float(rng.random() < 0.5)))
    return out


def test_pack_fills_rows_first_fit_and_keeps_every_sample_once():
    from agentrl.learner.packing import pack

    rows = pack([5, 9, 3, 12, 4], max_tokens=12)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3, 4]
    assert all(sum([5, 9, 3, 12, 4][i] for i in r) <= 12 for r in rows)
    assert rows[0] == [3] and len(rows) == 3
    assert pack([20], max_tokens=8) == [[0]]  # too long for a row: a row of its own


def test_packed_logprobs_equal_padded_logprobs(tiny_model):
    from transformers import AutoModelForCausalLM

    from agentrl.learner.packing import packed_logprobs, pad_batch, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    samples = make_samples(6, seed=1)
    t = pad_batch(samples, pad_id=0)
    with torch.no_grad():
        padded = token_logprobs(model, t["input_ids"], t["attention_mask"])
        packed = packed_logprobs(model, samples)
    valid = torch.zeros_like(padded, dtype=torch.bool)
    for i, s in enumerate(samples):
        valid[i, : len(s.token_ids) - 1] = True
    assert packed.shape == padded.shape
    assert (packed[valid] - padded[valid]).abs().max().item() < 1e-5
    assert (packed[~valid] == 0).all()


def test_train_step_packing_equals_one_sample_per_pass(tiny_model):
    from agentrl.config import LearnConfig
    from agentrl.learner.dist import Dist, load_model
    from agentrl.learner.step import build_state, train_step

    samples = make_samples(8, seed=2)
    results = []
    for tokens in (10_000, 2):  # everything in one row / one sample per row
        torch.manual_seed(0)
        cfg = LearnConfig(micro_batch_tokens=tokens, lr=1e-3)
        state = build_state(cfg, load_model(tiny_model, Dist()), Dist())
        stats = train_step(state, samples, cfg, version=1)
        params = torch.cat([p.detach().flatten() for p in state.model.parameters()])
        results.append((stats, params))
    (a, pa), (b, pb) = results
    assert a["packed_rows"] == 1 and b["packed_rows"] == 8
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(b["loss"]))
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"]
    assert (pa - pb).abs().max().item() < 1e-5


def test_a_train_step_on_samples_decoded_as_arrays_equals_one_on_lists(tiny_model):
    import json

    from agentrl.buffer.codec import Batch, decode_batch, encode_batch
    from agentrl.config import LearnConfig
    from agentrl.learner.dist import Dist, load_model
    from agentrl.learner.step import build_state, train_step

    samples = make_samples(8, seed=3)
    arrays = decode_batch(encode_batch(Batch("b", samples, 1))).samples  # what ServeSource gets
    lists = decode_batch(encode_batch(Batch("b", samples, 1))).samples  # same float32-rounded logprobs
    results = []
    for batch in (lists, arrays):
        torch.manual_seed(0)
        cfg = LearnConfig(micro_batch_tokens=64, lr=1e-3)
        state = build_state(cfg, load_model(tiny_model, Dist()), Dist())
        stats = train_step(state, batch, cfg, version=1)
        json.dumps(stats)  # the learner journals these: no numpy scalars
        results.append((stats, torch.cat([p.detach().flatten() for p in state.model.parameters()])))
    (a, pa), (b, pb) = results
    assert a["tokens"] == b["tokens"] and a["trained_samples"] == b["trained_samples"] == 8
    assert a["staleness_max"] == b["staleness_max"] == 1 and a["loss"] == b["loss"]
    assert torch.equal(pa, pb)
